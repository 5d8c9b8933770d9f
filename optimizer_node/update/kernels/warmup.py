"""Compiling the update loop ahead of use, in a process of its own.

numba compiles while holding the GIL: a node that compiled in its own process would answer nobody
for as long (17 s on a loaded 2-core machine), and its workers would take it for dead. So when
numba's on-disk cache lacks the loop's variants, a child process compiles every variant a node can
call (1 to ``MAX_TERMS`` gradient terms, fp32 and bf16, serial and parallel) and fills the cache;
the node then loads them from it (milliseconds each). This module is what the child runs;
:mod:`optimizer_node.update.kernels.compiled_cache` decides when. ``python -m optimizer_node.update.kernels.warmup`` does
it by hand, e.g. in a container image.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import numpy as np
import torch

from optimizer_node.update.adamw import AdamWHyper
from optimizer_node.update.kernels import compiled_update


def _variants() -> list[tuple[torch.dtype, bool, int, torch.dtype | None]]:
    """(frame dtype, fp32 head first, frames, outgoing copy's dtype) for every call the update pass can
    make: fp32 frames with no copy or an fp32 one (a parameter board), bf16 frames with a bf16 copy."""
    fp32 = [(torch.float32, False, n, wire) for wire in (None, torch.float32) for n in range(1, compiled_update.MAX_TERMS + 1)]
    bf16 = [(torch.bfloat16, head, n, torch.bfloat16) for head in (False, True) for n in range(1, compiled_update.MAX_TERMS + 1 - head)]
    return fp32 + bf16


def warm_up() -> None:
    """Call every variant once, serial and parallel, on a few elements (compiling or loading each)."""
    numel = 64
    blocks = np.array([[0, numel]], dtype=np.int64)
    hyper = AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.0)
    for dtype, with_head, count, wire_dtype in _variants():
        head = torch.zeros(numel) if with_head else None
        frames = [torch.zeros(numel, dtype=dtype) for _ in range(count)]
        wire = torch.empty(numel, dtype=wire_dtype) if wire_dtype is not None else None
        for serial in (True, False):
            param, exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
            compiled_update.update(param, exp_avg, exp_avg_sq, head, frames, wire, blocks, hyper, 1.0, 1.0, torch.empty(numel), serial=serial)
    compiled_update.warm_up_count()


def _end_with_parent(parent: int) -> None:
    """Be sent SIGTERM when the node that started this compile (process ``parent``) goes (Linux): a
    node stopped during its first minute would otherwise leave this child compiling on alone, on the
    CPUs of what runs next."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it went before the signal was asked for (while this one imported)
        raise SystemExit(1)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


if __name__ == "__main__":
    if len(sys.argv) > 1:  # python -m optimizer_node.update.kernels.warmup [PARENT_PID]
        _end_with_parent(int(sys.argv[1]))
    warm_up()
