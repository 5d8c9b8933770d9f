"""Crash-safe checkpoints of a node's state.

One directory per checkpoint, ``step-NNNNNNNNNN/``, holding one file per bucket (fp32 parameters,
``exp_avg`` and ``exp_avg_sq`` back to back) and ``manifest.json``, which names every file with its
size and SHA-256 and is written last. The directory is assembled under a temporary name, every file
and the directory are fsynced, and only then is it renamed into place; ``latest`` (a file holding
the newest directory's name) is replaced atomically afterwards. A crash at any point leaves either
the previous checkpoint or the new one, never half of one; a damaged checkpoint is detected by its
checksums and skipped for the previous complete one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from optimizer_node.storage import BucketState

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{10})$")


class CheckpointError(Exception):
    """A checkpoint that cannot be written or read; the message says which and why."""


@dataclass(slots=True)
class BucketSnapshot:
    bucket_id: int
    step: int
    step_tensor: float
    param: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


@dataclass(slots=True)
class Checkpoint:
    """A checkpoint read back and verified."""

    path: Path
    manifest: dict[str, Any]
    buckets: dict[int, BucketSnapshot]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, chunks: Iterable[memoryview | bytes]) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as handle:
        for chunk in chunks:
            handle.write(chunk)
            digest.update(chunk)
            size += len(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    return size, digest.hexdigest()


def _raw(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().contiguous().numpy()).cast("B")


def step_directory(root: Path, step: int) -> Path:
    return root / f"step-{step:010d}"


def write_checkpoint(
    root: Path,
    *,
    step: int,
    states: Iterable[BucketState],
    meta: dict[str, Any],
    keep: int,
    after_file: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Write a checkpoint of ``states`` (all at ``step``) under ``root``; returns its manifest.

    ``meta`` (the job, the node index, the overrides) goes into the manifest. ``keep`` complete
    checkpoints are kept, older ones are removed. Raises :class:`CheckpointError` (nothing of the new
    checkpoint left behind, the previous ones untouched) when the directory is unwritable or full.
    """
    final = step_directory(root, step)
    temporary = root / f".tmp-{final.name}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if final.exists():
            shutil.rmtree(final)  # an older run's checkpoint of the same step; ours replaces it
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
        files = {}
        for state in states:
            if state.step != step:
                raise CheckpointError(f"bucket {state.bucket_id} is at step {state.step}, not {step}: checkpoints are taken between steps")
            name = f"bucket-{state.bucket_id:06d}.bin"
            size, digest = _write_synced(temporary / name, [_raw(state.param), _raw(state.exp_avg), _raw(state.exp_avg_sq)])
            files[name] = {
                "bucket_id": state.bucket_id,
                "numel": state.numel,
                "step": state.step,
                "step_tensor": float(state.step_tensor),
                "bytes": size,
                "sha256": digest,
            }
            after_file()
        manifest = {"format_version": FORMAT_VERSION, "step": step, "created_unix": time.time(), **meta, "files": files}
        _write_synced(temporary / MANIFEST, [json.dumps(manifest, indent=1).encode()])
        _fsync_dir(temporary)
        os.rename(temporary, final)
        _fsync_dir(root)
        pointer = root / f"{LATEST}.tmp"
        _write_synced(pointer, [final.name.encode()])
        os.replace(pointer, root / LATEST)
        _fsync_dir(root)
    except OSError as exc:
        shutil.rmtree(temporary, ignore_errors=True)
        raise CheckpointError(f"cannot write checkpoint of step {step} under {root}: {exc.strerror or exc}") from exc
    except CheckpointError:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    prune(root, keep)
    return manifest


def prune(root: Path, keep: int) -> None:
    """Remove all but the ``keep`` newest checkpoints, and leftovers of interrupted writes."""
    for leftover in root.glob(".tmp-step-*"):
        if not leftover.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(leftover, ignore_errors=True)
    for old in list_checkpoints(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories under ``root``, newest first (complete or not)."""
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir() if path.is_dir() and _STEP_DIR.match(path.name)]
    return sorted(found, key=lambda path: path.name, reverse=True)


def read_checkpoint(path: Path) -> Checkpoint:
    """Read and verify one checkpoint directory; :class:`CheckpointError` says what is wrong."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {MANIFEST}: an interrupted write") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / MANIFEST} is unreadable: {exc}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {manifest.get('format_version')!r}, this netoptim reads {FORMAT_VERSION}")
    buckets = {}
    for name, entry in manifest["files"].items():
        try:
            data = (path / name).read_bytes()
        except OSError as exc:
            raise CheckpointError(f"{path / name}: {exc.strerror or exc}") from None
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise CheckpointError(
                f"{path / name} does not match its checksum in the manifest ({len(data)} bytes, {entry['bytes']} expected): the file is damaged"
            )
        numel = entry["numel"]
        values = torch.frombuffer(bytearray(data), dtype=torch.float32)
        if values.numel() != 3 * numel:
            raise CheckpointError(f"{path / name} holds {values.numel()} values, {3 * numel} expected")
        buckets[entry["bucket_id"]] = BucketSnapshot(
            entry["bucket_id"], entry["step"], entry["step_tensor"], values[:numel], values[numel : 2 * numel], values[2 * numel :]
        )
    return Checkpoint(path, manifest, buckets)


def read_latest(root: Path) -> Checkpoint | None:
    """The newest complete, intact checkpoint under ``root``; damaged ones are reported and skipped."""
    for path in list_checkpoints(root):
        try:
            return read_checkpoint(path)
        except CheckpointError as exc:
            log.error("skipping checkpoint %s: %s", path.name, exc)
    return None


def resolve(path: Path) -> Checkpoint:
    """A checkpoint given as its own directory or as a checkpoint root (then the newest intact one)."""
    if (path / MANIFEST).exists():
        return read_checkpoint(path)
    latest = read_latest(path)
    if latest is None:
        raise CheckpointError(f"no intact checkpoint under {path}")
    return latest
