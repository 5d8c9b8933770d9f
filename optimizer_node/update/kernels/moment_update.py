"""The compiled AdamW update of compressed moments (numba, optional): one pass over the compressed
segments of a bucket that decodes, updates and encodes each piece in cache
(:mod:`optimizer_node.update.kernels._numba_moments`).

Bitwise equal to the torch-ops path of :mod:`optimizer_node.update.moment_pass` (decode a segment,
torch's fused AdamW, encode), which is the definition: before first use, :func:`ready` runs the
caller's check of both on random buckets in a background thread and uses the loop only if every bit
agrees; until then, or without numba (``NETOPTIM_COMPILED_UPDATE=0``
too), the torch path runs.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import torch

from optimizer_node.moments.codec import MomentCodec
from optimizer_node.update.kernels import compiled_update
from protos.job.hyper import AdamWHyper

log = logging.getLogger(__name__)

BF16_ROW = 16384
"""Elements per row of the bf16 loop (one thread's piece: its scratch stays in cache)."""


@functools.cache
def _kernels() -> SimpleNamespace:
    import numba

    from optimizer_node.update.kernels import _numba_moments

    return SimpleNamespace(
        numba=numba,
        update_8bit=_numba_moments.update_8bit,
        update_bf16=_numba_moments.update_bf16_moments,
    )


_scratch = threading.local()


def _scratch_for(threads: int, length: int) -> np.ndarray:
    """Per numba thread, two fp32 rows of ``length`` (made once per calling thread and size)."""
    held = getattr(_scratch, "array", None)
    if held is None or held.shape[0] < threads or held.shape[2] < length:
        held = _scratch.array = np.empty((max(threads, compiled_update._numba_threads()), 2, length), dtype=np.float32)
    return held


def update(
    codec: MomentCodec,
    param: torch.Tensor,
    grads: tuple[torch.Tensor, ...],
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: AdamWHyper,
    step: float,
    divisor: float,
) -> None:
    """AdamW at ``step`` (already incremented) on the bucket's compressed segments, ``param`` in
    place, the gradient the sum of the one or two fp32 ``grads`` divided by
    ``divisor``; ``exp_avg``/``exp_avg_sq`` the encoded moments, updated in place. The plain
    segments are the caller's."""
    kernels = _kernels()
    threads = compiled_update._use_threads(kernels)
    consts = compiled_update.constants(hyper, step, divisor)
    work = codec.rows(codec.block if codec.format == "8bit" else BF16_ROW)
    a = grads[0].numpy()
    b = grads[1].numpy() if len(grads) == 2 else a
    pair = len(grads) == 2
    m_values, m_scales, _ = codec.parts(exp_avg)
    v_values, v_scales, _ = codec.parts(exp_avg_sq)
    with compiled_update._one_parallel_loop_at_a_time():
        if codec.format == "8bit":
            scratch = _scratch_for(threads, codec.block)
            kernels.update_8bit(
                param.numpy(), a, b, pair, m_values.numpy(), m_scales.numpy(), v_values.numpy(), v_scales.numpy(),
                work, codec.block, scratch, *consts,
            )  # fmt: skip
        else:
            m_bits = m_values.view(torch.int16).numpy().view(np.uint16)
            v_bits = v_values.view(torch.int16).numpy().view(np.uint16)
            kernels.update_bf16(param.numpy(), a, b, pair, m_bits, v_bits, work, *consts)


_settled: bool | None = None


def ready(check: Callable[[], str | None]) -> bool:
    """Whether the loop may run now: ``check`` (the loop against the torch path: the first difference,
    or ``None``) runs once, in the background; False meanwhile, and for good where the loop is off,
    absent or differs."""
    global _settled
    if _settled is not None:
        return _settled
    future = _checked(check)
    if not future.done():
        return False
    _settled = future.result()
    return _settled


def wait_ready(check: Callable[[], str | None]) -> bool:
    """:func:`ready`, waiting for the check (benchmarks, tests)."""
    _checked(check).result()
    return ready(check)


def forget_check() -> None:
    """Check again on next use (tests)."""
    global _settled
    _settled = None
    _check_started.clear()


_check_started: list[Future[bool]] = []


def _checked(check: Callable[[], str | None]) -> Future[bool]:
    if _check_started:
        return _check_started[0]
    future: Future[bool] = Future()
    _check_started.append(future)
    if not compiled_update._enabled():
        future.set_result(False)
    else:
        threading.Thread(target=lambda: future.set_result(_check(check)), name="moment-update-check", daemon=True).start()
    return future


def _check(check: Callable[[], str | None]) -> bool:
    try:
        mismatch = check()
    except Exception as exc:  # a numba that cannot compile here: torch ops do the update
        log.warning("the compiled update of compressed moments is unavailable (%s: %s); updating with torch ops", type(exc).__name__, exc)
        return False
    if mismatch:
        log.warning("the compiled update of compressed moments differs from torch ops here (%s); updating with torch ops", mismatch)
    return not mismatch
