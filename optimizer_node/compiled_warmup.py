"""Compiling the update loop ahead of use, in a process of its own.

numba compiles while holding the GIL: a node that compiled in its own process would answer nobody
for as long (17 s on a loaded 2-core machine), and its workers would take it for dead. So when
numba's on-disk cache lacks the loop's variants, a child process compiles every variant a node can
call (1 to ``MAX_TERMS`` gradient terms, fp32 and bf16, serial and parallel) and fills the cache;
the node then loads them from it (milliseconds each). ``python -m optimizer_node.compiled_warmup``
does it by hand, e.g. in a container image.
"""

from __future__ import annotations

import fcntl
import logging
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from optimizer_node import compiled_update
from optimizer_node.adamw import AdamWHyper

log = logging.getLogger(__name__)

WARMUP_TIMEOUT_S = 900.0


def _variants() -> list[tuple[torch.dtype, bool, int]]:
    """(frame dtype, fp32 head first, frames) for every call the update pass can make."""
    fp32 = [(torch.float32, False, n) for n in range(1, compiled_update.MAX_TERMS + 1)]
    bf16 = [(torch.bfloat16, head, n) for head in (False, True) for n in range(1, compiled_update.MAX_TERMS + 1 - head)]
    return fp32 + bf16


def warm_up() -> None:
    """Call every variant once, serial and parallel, on a few elements (compiling or loading each)."""
    numel = 64
    blocks = np.array([[0, numel]], dtype=np.int64)
    hyper = AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.0)
    for dtype, with_head, count in _variants():
        head = torch.zeros(numel) if with_head else None
        frames = [torch.zeros(numel, dtype=dtype) for _ in range(count)]
        wire = torch.empty(numel, dtype=torch.bfloat16) if dtype == torch.bfloat16 else None
        for serial in (True, False):
            param, exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
            compiled_update.update(param, exp_avg, exp_avg_sq, head, frames, wire, blocks, hyper, 1.0, 1.0, torch.empty(numel), serial=serial)


def cache_complete() -> bool:
    """Whether numba's cache holds every variant (as far as its index files tell)."""
    kernels = compiled_update._kernels()
    expected = {"update_fp32": compiled_update.MAX_TERMS, "update_bf16": compiled_update.MAX_TERMS}  # one signature per tuple length
    try:
        for name, count in expected.items():
            for dispatcher in (getattr(kernels, name), getattr(kernels, f"{name}_serial")):
                index = dispatcher._cache._cache_file._load_index()  # numba's internals: any surprise means "compile"
                if len(index) < count:
                    return False
    except Exception:
        return False
    return True


def fill_cache() -> None:
    """Compile the variants the cache lacks in a child process (this one keeps answering meanwhile).
    Processes that start together compile once: the others wait for the first, on a file lock."""
    if cache_complete():
        return
    lock_dir = Path(compiled_update._kernels().update_fp32._cache._cache_path)
    try:
        lock_dir.mkdir(parents=True, exist_ok=True)
        with open(lock_dir / "netoptim-warmup.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not cache_complete():
                _compile_in_child()
    except OSError:  # no lock where the cache is: compile without one
        _compile_in_child()


def _compile_in_child() -> None:
    log.info("compiling the node's update loop in a child process (once per installation; about a minute)")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "optimizer_node.compiled_warmup"], capture_output=True, text=True, timeout=WARMUP_TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(f"compiling the update loop failed (exit {result.returncode}): {result.stderr[-2000:]}")
    log.info("the update loop is compiled (%.0f s)", time.monotonic() - started)


if __name__ == "__main__":
    warm_up()
