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
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from optimizer_node.state.storage import BucketState, write_synced

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{10})$")


class CheckpointError(Exception):
    """A checkpoint that cannot be written or read; the message says which and why."""


@dataclass(slots=True)
class BucketSnapshot:
    """One verified bucket file of a checkpoint; its tensors are read when asked for."""

    bucket_id: int
    step: int
    step_tensor: float
    numel: int
    path: Path
    segment_steps: list[float] | None = None  # per segment, when they differ (see BucketState)
    moment_bytes: int = -1  # bytes of each moment as stored (optimizer_node.moments); -1: fp32, 4 x numel

    def __post_init__(self) -> None:
        if self.moment_bytes < 0:
            self.moment_bytes = 4 * self.numel

    def values(self) -> torch.Tensor:
        """param, exp_avg and exp_avg_sq back to back (3 x numel fp32; a checkpoint of fp32 moments)."""
        if self.moment_bytes != 4 * self.numel:
            raise CheckpointError(f"{self.path} holds compressed moments: read them through the job's moment codec")
        return torch.from_file(str(self.path), shared=False, size=3 * self.numel, dtype=torch.float32)

    @property
    def param(self) -> torch.Tensor:
        return torch.from_file(str(self.path), shared=False, size=self.numel, dtype=torch.float32)


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
    written = write_synced(path, [memoryview(chunk) for chunk in chunks])
    return int(written["bytes"]), str(written["sha256"])


def step_directory(root: Path, step: int) -> Path:
    return root / f"step-{step:010d}"


def write_checkpoint(
    root: Path,
    *,
    step: int,
    states: Iterable[BucketState],
    meta: dict[str, Any],
    keep: int,
    write_file: Callable[[BucketState, Path], dict[str, int | str]],
    after_file: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Write a checkpoint of ``states`` (all at ``step``) under ``root``; returns its manifest.

    ``meta`` (the job, the node index, the overrides) goes into the manifest; ``write_file`` puts one
    bucket's state in a file (the store's :meth:`~optimizer_node.state.storage.BucketStore.write_checkpoint_file`:
    written out, or hard-linked by an out-of-core store). ``keep`` complete
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
            written = write_file(state, temporary / name)
            files[name] = {"bucket_id": state.bucket_id, "numel": state.numel, "step": state.step, "step_tensor": float(state.step_tensor), **written}
            if state.codec is not None:
                files[name]["moment_bytes"] = state.moment_bytes
            if state.segment_steps is not None:
                files[name]["segment_steps"] = list(state.segment_steps)
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
    """Remove all but the ``keep`` newest automatic checkpoints (periodic, at exit), and leftovers of
    interrupted writes. Checkpoints an operator asked for (``admin checkpoint``, ``admin drain``:
    ``"origin": "manual"`` in the manifest) are never removed here."""
    for leftover in root.glob(".tmp-step-*"):
        if not leftover.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(leftover, ignore_errors=True)
    automatic = [path for path in list_checkpoints(root) if checkpoint_origin(path) != "manual"]
    for old in automatic[keep:]:
        shutil.rmtree(old, ignore_errors=True)


FINISHED = "finished"
"""Under a checkpoint directory: one directory per job the node let go, holding that job's checkpoints."""


def archive_checkpoints(root: Path, name: str) -> Path | None:
    """Move every checkpoint under ``root`` (and its ``latest`` pointer) into ``root/finished/name/``,
    so that the next job's checkpoints start afresh and ``--resume`` finds only them; the archived
    directory is itself a checkpoint directory (``netoptim export``, ``--resume`` pointed at it).
    Returns it, or ``None`` when there was nothing to move."""
    found = list_checkpoints(root)
    if not found:
        return None
    target = root / FINISHED / name
    suffix = 1
    while target.exists():  # the same job let go twice at the same step
        suffix += 1
        target = root / FINISHED / f"{name}-{suffix}"
    target.mkdir(parents=True)
    for path in found:
        os.replace(path, target / path.name)
    if (root / LATEST).exists():
        os.replace(root / LATEST, target / LATEST)
    _fsync_dir(target)
    _fsync_dir(root)
    return target


def checkpoint_origin(path: Path) -> str:
    """``manual`` or ``automatic`` (also for a checkpoint of an older version, or an incomplete one)."""
    try:
        origin = json.loads((path / MANIFEST).read_text()).get("origin")
    except (OSError, ValueError, AttributeError):
        return "automatic"
    return "manual" if origin == "manual" else "automatic"


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
        kinds = [kind for kind in _DIGESTS if kind in entry]
        if not kinds:  # nothing to check it against: a file that changed would be read as good
            raise CheckpointError(f"{path / MANIFEST}: {name} has no checksum ({', '.join(_DIGESTS)}); the manifest is damaged")
        size, digests = _digest_file(path / name, kinds=kinds)
        if size != entry["bytes"] or any(entry.get(kind, value) != value for kind, value in digests.items()):
            raise CheckpointError(f"{path / name} does not match its checksum in the manifest ({size} bytes, {entry['bytes']} expected): the file is damaged")
        numel = entry["numel"]
        moment = entry.get("moment_bytes", 4 * numel)
        if size != 4 * numel + 2 * moment:
            raise CheckpointError(f"{path / name} holds {size} bytes, {4 * numel + 2 * moment} expected (parameters and two moments of {moment} bytes)")
        segment_steps = entry.get("segment_steps")
        if segment_steps is not None and not (isinstance(segment_steps, list) and all(isinstance(s, (int, float)) and s >= 0 for s in segment_steps)):
            raise CheckpointError(f"{path / MANIFEST}: segment_steps of {name} must be a list of non-negative numbers, got {segment_steps!r}")
        buckets[entry["bucket_id"]] = BucketSnapshot(
            entry["bucket_id"],
            entry["step"],
            entry["step_tensor"],
            numel,
            path / name,
            None if segment_steps is None else [float(s) for s in segment_steps],
            moment,
        )
    return Checkpoint(path, manifest, buckets)


class _Crc32:
    """zlib's CRC-32 with a hasher's ``update``, for manifests written before XXH3."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, chunk: bytes) -> None:
        self.value = zlib.crc32(chunk, self.value)


_DIGESTS: dict[str, tuple[Callable[[], Any], Callable[[Any], str | int]]] = {
    "sha256": (hashlib.sha256, lambda hasher: hasher.hexdigest()),  # what a node in memory writes
    "xxh3_64": (xxhash.xxh3_64, lambda hasher: hasher.intdigest()),  # what an out-of-core store recorded as it wrote the file
    "crc32": (_Crc32, lambda hasher: hasher.value),  # an out-of-core node's, before XXH3
}
"""The checksums a manifest entry may carry: how to start one, and its value once fed the file."""


def _digest_file(path: Path, *, kinds: list[str], block: int = 8 << 20) -> tuple[int, dict[str, str | int]]:
    """Size and the checksums of ``kinds`` (names in :data:`_DIGESTS`) of a file, read in blocks (never
    whole into memory)."""
    hashers = {kind: _DIGESTS[kind][0]() for kind in kinds}
    size = 0
    try:
        with open(path, "rb") as handle:
            while chunk := handle.read(block):
                size += len(chunk)
                for hasher in hashers.values():
                    hasher.update(chunk)
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc.strerror or exc}") from None
    return size, {kind: _DIGESTS[kind][1](hasher) for kind, hasher in hashers.items()}


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
