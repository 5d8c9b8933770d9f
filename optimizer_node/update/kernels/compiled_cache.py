"""When the compiled update loop is compiled: ahead of use, in a child process, once.

numba compiles while holding the GIL, so a node that compiled the loop itself would answer nobody
for as long (17 s on a loaded 2-core machine) and its workers would take it for dead. When numba's
on-disk cache lacks some of the loop's variants, :func:`fill_cache` runs
``python -m optimizer_node.update.kernels.warmup`` (which compiles them all) and waits for it; processes
that start together compile once, behind a file lock in the cache's directory.

The bitwise check of the loop against torch's kernel (:mod:`optimizer_node.update.kernels.compiled_update`) takes
most of a second; its verdict is put on record beside numba's cache under a fingerprint of
everything it depends on (:func:`build_fingerprint`), so it runs once per build and CPU, like the
compilation, rather than in every node process.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

log = logging.getLogger(__name__)

WARMUP_TIMEOUT_S = 900.0


def cache_complete(kernels: SimpleNamespace, max_terms: int) -> bool:
    """Whether numba's cache holds every variant of ``kernels`` (as far as its index files tell)."""
    # one signature per tuple length; fp32 frames twice: without an outgoing copy and with an fp32 one
    # and the non-finite count: over fp32 bits and over 16-bit ones
    expected = {"update_fp32": 2 * max_terms, "update_bf16": max_terms, "count_exponent_all_ones": 2}
    try:
        for name, count in expected.items():
            for dispatcher in (getattr(kernels, name), getattr(kernels, f"{name}_serial")):
                index = dispatcher._cache._cache_file._load_index()  # numba's internals: any surprise means "compile"
                if len(index) < count:
                    return False
    except Exception:
        return False
    return True


def fill_cache(kernels: SimpleNamespace, max_terms: int) -> None:
    """Compile the variants the cache lacks in a child process (this one keeps answering meanwhile).
    Processes that start together compile once: the others wait for the first, on a file lock."""
    if cache_complete(kernels, max_terms):
        return
    lock_dir = Path(kernels.update_fp32._cache._cache_path)
    try:
        lock_dir.mkdir(parents=True, exist_ok=True)
        with open(lock_dir / "netoptim-warmup.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not cache_complete(kernels, max_terms):
                _compile_in_child()
    except OSError:  # no lock where the cache is: compile without one
        _compile_in_child()


def _compile_in_child() -> None:
    log.info("compiling the node's update loop in a child process (once per installation; about a minute)")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "optimizer_node.update.kernels.warmup", str(os.getpid())], capture_output=True, text=True, timeout=WARMUP_TIMEOUT_S
    )
    if result.returncode != 0:
        raise RuntimeError(f"compiling the update loop failed (exit {result.returncode}): {result.stderr[-2000:]}")
    log.info("the update loop is compiled (%.0f s)", time.monotonic() - started)


VERDICT_FILE = "netoptim-check.json"


def build_fingerprint(sources: list[Path]) -> str:
    """What the loop's bitwise check depends on: the loop's source, the versions of everything that
    compiles or runs it (Python, numpy, numba and its LLVM, torch, whose kernel it is compared
    with) and the CPU it runs on (its LLVM name and features)."""
    import llvmlite.binding as llvm
    import numba
    import numpy
    import torch

    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.read_bytes())
    for part in (sys.version, platform.machine(), numpy.__version__, numba.__version__, llvm.llvm_version_info, torch.__version__, llvm.get_host_cpu_name()):
        digest.update(str(part).encode())
    digest.update(llvm.get_host_cpu_features().flatten().encode())
    return digest.hexdigest()


def recorded_verdict(directory: Path, fingerprint: str) -> tuple[bool, str | None]:
    """Whether a check of this build is on record in ``directory``, and its verdict (the first
    difference found, or ``None``: bitwise equal)."""
    try:
        records = json.loads((directory / VERDICT_FILE).read_text())
        verdict = records[fingerprint]
    except (OSError, ValueError, KeyError, TypeError):
        return False, None
    return (True, verdict) if verdict is None or isinstance(verdict, str) else (False, None)


def record_verdict(directory: Path, fingerprint: str, verdict: str | None) -> None:
    """Put this build's verdict on record (atomically; older builds' records are dropped), so that
    the next process of the same build need not run the check again; nowhere to write it is fine."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / VERDICT_FILE
        temporary = target.with_name(f"{VERDICT_FILE}.{os.getpid()}")
        temporary.write_text(json.dumps({fingerprint: verdict}))
        os.replace(temporary, target)
    except OSError as exc:
        log.debug("the compiled loop's check could not be put on record in %s: %s", directory, exc)
