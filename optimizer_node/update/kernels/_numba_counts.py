"""The non-finite count's numba functions (imported with the update's, by
:mod:`optimizer_node.update.kernels.compiled_update`): NaN and inf found in a gradient on the update's own threads."""

from __future__ import annotations

import numpy as np
from numba import prange

from optimizer_node.update.kernels._numba_loops import _jit

# Non-finite gradients: an element is NaN or +-inf exactly when its exponent bits are all ones. The
# test is on the bits (an integer count LLVM vectorizes; a float sum's order would stop it) and runs
# on the update's own threads: a check on torch's pool would leave that pool's threads spinning
# while the update starts on numba's (two OpenMP runtimes in one process).


@_jit()  # a function of its own, not inlined: inside the parallel loop's body LLVM would not vectorize it
def _count_all_ones(bits, mask):  # pragma: no cover - compiled
    count = np.uint32(0)  # at most 2**32 - 1 elements a call (a chunk, or a view counted serially)
    for i in range(bits.shape[0]):
        count += np.uint32((bits[i] & mask) == mask)
    return count


@_jit(parallel=True)
def count_exponent_all_ones(bits, mask, chunk):  # pragma: no cover - compiled
    """How many elements of ``bits`` (fp32 as uint32, or 16-bit floats as uint16) have every bit of
    ``mask`` (the exponent's) set; ``chunk`` elements a task, over the threads."""
    chunks = (bits.shape[0] + chunk - 1) // chunk
    total = 0
    for c in prange(chunks):
        total += np.int64(_count_all_ones(bits[c * chunk : min(bits.shape[0], (c + 1) * chunk)], mask))
    return total


@_jit()
def count_exponent_all_ones_serial(bits, mask, chunk):  # pragma: no cover - compiled
    """``count_exponent_all_ones`` in the calling thread."""
    total = 0
    for lo in range(0, bits.shape[0], chunk):
        total += np.int64(_count_all_ones(bits[lo : lo + chunk], mask))
    return total
