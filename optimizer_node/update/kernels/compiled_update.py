"""The node's one-pass update as one compiled loop (numba, optional): for each element, add the
workers' gradients in rank order and apply AdamW, reading each input once and writing the parameter
and both moments once.

torch's fused AdamW kernel takes a ready gradient, so with torch ops alone the sum is an op of its
own, and its memory reads cannot overlap with the kernel's. This loop does both at once. It must be
bitwise equal to ``torch._fused_adamw_``, so it repeats the arithmetic of that kernel's vector path
(aten/src/ATen/native/cpu/FusedAdamKernel.cpp) operation by operation in fp32, with its constants
rounded from the same float64 values: the gradient divided by the number of workers, the decayed
parameter, ``exp_avg.lerp_(grad, 1 - beta1)`` as one fused multiply-add, and ``exp_avg_sq`` with the
one multiply-add that torch's build fuses, ``fma((1 - beta2) * g, g, exp_avg_sq * beta2)`` (of the
possible orders, the only one that matched torch bit for bit on 3M random elements).

What is build-dependent is checked, not assumed: before first use, :func:`usable` runs this loop and
torch's kernel on the same random inputs (both lerp branches, with and without weight decay,
several steps, bf16 and fp32 gradients) and uses the loop only if every bit agrees; otherwise, or
without numba, the caller falls back to torch ops. Each parameter piece's last ``numel % 64``
elements are left to torch's kernel, whose scalar tail rounds differently (see
:mod:`optimizer_node.update.bucket_pass`).

``NETOPTIM_COMPILED_UPDATE=0`` turns the loop off. The compiled code is cached on disk by numba.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import math
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from optimizer_node.update.adamw import AdamWHyper
from optimizer_node.update.kernels import compiled_cache

log = logging.getLogger(__name__)

BLOCK = 16384
"""Elements per block, the unit spread over the threads (numba's ``prange``); with three or more
workers, a block's sum of all but the last gradient (64 KiB) is made first and read from cache."""


def _enabled() -> bool:
    return os.environ.get("NETOPTIM_COMPILED_UPDATE", "1") != "0" and importlib.util.find_spec("numba") is not None


_calling_thread = threading.local()


@functools.cache
def _kernels() -> SimpleNamespace:
    """The numba functions, imported (and compiled, or loaded from numba's cache) on first use."""
    import numba

    from optimizer_node.update.kernels import _numba_kernels

    return SimpleNamespace(
        numba=numba,
        update_fp32=_numba_kernels.update_fp32,
        update_bf16=_numba_kernels.update_bf16,
        update_fp32_serial=_numba_kernels.update_fp32_serial,
        update_bf16_serial=_numba_kernels.update_bf16_serial,
        cast_bf16=_numba_kernels.cast_bf16,
        count_exponent_all_ones=_numba_kernels.count_exponent_all_ones,
        count_exponent_all_ones_serial=_numba_kernels.count_exponent_all_ones_serial,
    )


_workqueue_lock = threading.Lock()
_NO_LOCK = contextlib.nullcontext()  # reusable: made once, not at every update
_concurrent_ok: bool | None = None  # whether numba's threading layer takes parallel loops from two threads at once


def _one_parallel_loop_at_a_time() -> contextlib.AbstractContextManager:
    """A node with ``--pass-thread`` runs a pass's parallel loop on its pass thread while the serve
    loop may count a push's NaN/inf on its own: numba's OpenMP and TBB layers take that, its
    ``workqueue`` layer aborts the process. Under ``workqueue`` (or before the layer is known) they
    take turns."""
    global _concurrent_ok
    if _concurrent_ok is None:
        try:
            _concurrent_ok = _kernels().numba.threading_layer() != "workqueue"
        except ValueError:  # no parallel loop ran yet: the layer is chosen at the first
            return _workqueue_lock
    return _NO_LOCK if _concurrent_ok else _workqueue_lock


def loop_threads() -> int:
    """The threads the loop runs on from this thread: torch's count, capped by numba's."""
    return max(1, min(torch.get_num_threads(), _numba_threads()))


@functools.cache
def _numba_threads() -> int:
    return _kernels().numba.config.NUMBA_NUM_THREADS  # fixed once numba is imported


def _use_threads(kernels: SimpleNamespace, threads: int | None = None) -> int:
    """Run numba's parallel loops from this thread on ``threads`` (default :func:`loop_threads`); the count."""
    threads = threads or loop_threads()
    if _calling_thread.__dict__.get("threads") != threads:  # numba's count is per calling thread
        torch_threads = torch.get_num_threads()
        kernels.numba.set_num_threads(threads)
        # The first call in a thread starts numba's OpenMP pool, which sets that thread's OpenMP count
        # to all the CPUs numba may use: torch's ops there, and loop_threads() after it, would then
        # run on every CPU, not on the node's --threads.
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
        _calling_thread.threads = threads
    return threads


@functools.lru_cache(maxsize=64)  # every bucket of a step shares them
def constants(hyper: AdamWHyper, step: float, divisor: float) -> tuple:
    """The kernel's fp32 constants, each rounded from the float64 value torch's kernel computes."""
    f32 = np.float32
    bias1 = 1 - hyper.beta1**step
    bias2 = 1 - hyper.beta2**step
    weight = f32(1 - hyper.beta1)
    lerp_from_m = bool(abs(weight) < f32(0.5))
    coeff = weight if lerp_from_m else f32(weight - f32(1))
    # torch's kernel computes 1 - lr * weight_decay with one rounding (its build contracts it to a fused
    # multiply-add): exact rational arithmetic rounded once gives the same double (lr * wd == 1 tells).
    decay = f32(float(1 - Fraction(hyper.lr) * Fraction(hyper.weight_decay))) if hyper.weight_decay != 0 else f32(1)  # x * 1 is x: same bits
    return (f32(divisor), decay, coeff, lerp_from_m, f32(hyper.beta2), f32(1 - hyper.beta2), f32(math.sqrt(bias2)), f32(hyper.eps), f32(-(hyper.lr / bias1)))


_NO_FP32 = np.empty(0, dtype=np.float32)  # "none" for the kernels' optional arrays
_NO_BF16 = np.empty(0, dtype=np.uint16)


def _array(tensor: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view (bf16 as its raw uint16 bits)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


MAX_TERMS = 4
"""Gradient terms (frames, and an fp32 head) the loop takes at most. Each count is a variant of its
own that numba compiles ahead of use (:mod:`optimizer_node.update.kernels.warmup`); more terms (arrivals
out of rank order with five or more workers) go through torch ops."""


def supports(head: torch.Tensor | None, frames: Sequence[torch.Tensor]) -> bool:
    """Whether the loop takes these terms: fp32 or bf16 frames of one dtype (an fp32 head first), at most ``MAX_TERMS`` in all."""
    if not frames or len(frames) + (head is not None) > MAX_TERMS:
        return False
    dtype = frames[0].dtype
    if dtype is not torch.float32 and dtype is not torch.bfloat16:
        return False
    for frame in frames:  # a loop, not a set: once a bucket, and one or two frames
        if frame.dtype is not dtype:
            return False
    return head is None or head.dtype is torch.float32


def update(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    head: torch.Tensor | None,
    frames: Sequence[torch.Tensor],
    wire: torch.Tensor | None,
    blocks: np.ndarray,
    hyper: AdamWHyper,
    step: float,
    divisor: float,
    previous: torch.Tensor | None = None,
    serial: bool | None = None,
    arrays: tuple[np.ndarray, ...] | None = None,
    threads: int | None = None,
    keep: bool = False,
) -> None:
    """Sum ``head`` (the partial sum, if any) and ``frames`` in order, divide by ``divisor`` and apply
    AdamW at ``step`` (already incremented) to the ``(start, stop)`` ranges in ``blocks``, in place;
    ``wire`` (bf16), if given, receives those ranges' new parameters as ``wire.copy_(param)`` would;
    ``previous`` (fp32), if given, receives their parameters as they were before the update.
    ``serial`` runs the blocks in this thread (default: with one thread or one block). ``arrays``:
    numpy views of ``param``, ``exp_avg``, ``exp_avg_sq`` the caller keeps (made here otherwise).
    ``threads``: :func:`loop_threads` as the caller found it for its plan (found here otherwise).
    ``keep`` (fp32 frames and an fp32 ``wire``): ``param`` is only read, the new parameters go to
    ``wire`` alone (a node's master values moving to its board's other slot)."""
    # Called once a bucket (thousands of times a step with small buckets): each line here is spelled
    # for the interpreter's fast paths, the kernel's call itself being a few microseconds.
    kernels = _kernels()
    threads = _use_threads(kernels, threads)
    consts = constants(hyper, step, divisor)
    p, m, v = arrays if arrays is not None else (param.numpy(), exp_avg.numpy(), exp_avg_sq.numpy())
    out = _NO_BF16 if wire is None else wire.numpy() if wire.dtype is torch.float32 else _array(wire)
    prev = previous.numpy() if previous is not None else _NO_FP32
    if serial is None:
        serial = threads == 1 or len(blocks) == 1  # a thread pool's start costs more than one block
    if frames[0].dtype is torch.float32:
        if keep and (wire is None or wire.dtype is not torch.float32):
            raise ValueError("keep needs an fp32 wire to write the new parameters into")
        terms = tuple([t.numpy() for t in frames] if head is None else [head.numpy(), *[t.numpy() for t in frames]])
        if serial:
            kernels.update_fp32_serial(p, m, v, terms, out, prev, keep, blocks, *consts)
        else:
            with _one_parallel_loop_at_a_time():
                kernels.update_fp32(p, m, v, terms, out, prev, keep, blocks, threads, *consts)
    else:
        if keep:
            raise ValueError("keep takes fp32 frames: a 16-bit wire's master values stay where they are")
        first = head.numpy() if head is not None else _NO_FP32
        bf16_terms = tuple([_array(t) for t in frames])
        if serial:
            kernels.update_bf16_serial(p, m, v, first, bf16_terms, out, prev, blocks, *consts)
        else:
            with _one_parallel_loop_at_a_time():
                kernels.update_bf16(p, m, v, first, bf16_terms, out, prev, blocks, *consts)


_EXPONENT_BITS = {  # the integer view of each float dtype, and its exponent's bits
    torch.float32: (torch.int32, np.uint32, np.uint32(0x7F800000)),
    torch.bfloat16: (torch.int16, np.uint16, np.uint16(0x7F80)),
    torch.float16: (torch.int16, np.uint16, np.uint16(0x7C00)),
}
CHECK_CHUNK = 65536
"""Elements per task of the parallel non-finite count; a view of at most one chunk is counted in the calling thread."""


def count_non_finite(view: torch.Tensor) -> int | None:
    """How many elements of the contiguous fp32/bf16/fp16 ``view`` are NaN or +-inf, counted on the
    update's threads; ``None`` where the compiled loop is not in use (yet: an update settled
    :func:`ready`; a node held to a memory budget never loads numba) or the view does not suit
    it (the caller counts with torch)."""
    bits = _EXPONENT_BITS.get(view.dtype)
    if bits is None or not view.is_contiguous() or _settled is not True:  # never the one to start the check (and load numba)
        return None
    integer, unsigned, mask = bits
    kernels = _kernels()
    raw = view.view(integer).numpy().view(unsigned)
    if _use_threads(kernels) == 1 or raw.shape[0] <= CHECK_CHUNK:
        return int(kernels.count_exponent_all_ones_serial(raw, mask, CHECK_CHUNK))
    with _one_parallel_loop_at_a_time():
        return int(kernels.count_exponent_all_ones(raw, mask, CHECK_CHUNK))


def warm_up_count() -> None:
    """Compile (or load) the non-finite count's variants: 32- and 16-bit, serial and parallel."""
    kernels = _kernels()
    for _integer, unsigned, mask in _EXPONENT_BITS.values():
        for count in (kernels.count_exponent_all_ones, kernels.count_exponent_all_ones_serial):
            count(np.zeros(64, dtype=unsigned), mask, CHECK_CHUNK)


def usable() -> bool:
    """Whether the loop is available here and bitwise equal to torch's kernel on this build; the first
    call runs the check (seconds: numba compiles, or loads its cache), later ones return at once."""
    return _checked().result()


def ready() -> bool:
    """:func:`usable`, without waiting: False while the check runs (it starts on the first call, in a
    thread of its own), so an update never waits for the compiler; torch ops give the same bits meanwhile."""
    global _settled
    if _settled is not None:
        return _settled
    future = _checked()
    if not future.done():
        return False
    _settled = future.result()  # settled for good: later calls (one per bucket update) skip the future's locks
    return _settled


_settled: bool | None = None


def path() -> str:
    """What a bucket update runs on now, without waiting or starting anything: ``"compiled"``,
    ``"torch-ops, checking the compiled loop"`` (the same bits meanwhile), ``"torch-ops until the first
    update checks the compiled loop"`` (the check loads ~140 MB of numba and LLVM: not before a job
    needs it), or ``"torch-ops"``."""
    if _settled is None and not _checked.cache_info().currsize:
        return "torch-ops until the first update checks the compiled loop" if _enabled() else "torch-ops"
    if ready():
        return "compiled"
    return "torch-ops" if _checked().done() else "torch-ops, checking the compiled loop"


def forget_check() -> None:
    """Run the check again on next use (after ``NETOPTIM_COMPILED_UPDATE`` changed; tests)."""
    global _settled
    _settled = None
    _checked.cache_clear()


@functools.cache
def _checked() -> Future[bool]:
    """The check, started once, in the background (settled at once where the loop is off or numba absent)."""
    future: Future[bool] = Future()
    if not _enabled():
        future.set_result(False)
    else:
        threading.Thread(target=lambda: future.set_result(_check()), name="compiled-update-check", daemon=True).start()
    return future


def _check() -> bool:
    try:
        kernels = _kernels()
        compiled_cache.fill_cache(kernels, MAX_TERMS)  # numba holds the GIL while it compiles: not in this process
        directory = Path(kernels.update_fp32._cache._cache_path)
        fingerprint = compiled_cache.build_fingerprint(
            [Path(__file__), *(Path(__file__).with_name(name) for name in ("_numba_kernels.py", "_numba_kernels.py", "self_check.py"))]
        )
        recorded, mismatch = compiled_cache.recorded_verdict(directory, fingerprint)
        if not recorded:  # once per build and CPU (compiled_cache), not in every process
            mismatch = run_self_check()
            compiled_cache.record_verdict(directory, fingerprint, mismatch)
    except Exception as exc:  # a numba that cannot compile here: torch ops do the update
        log.warning("the compiled update is unavailable (%s: %s); updating with torch ops", type(exc).__name__, exc)
        return False
    if mismatch:
        log.warning("the compiled update differs from torch's fused AdamW here (%s); updating with torch ops", mismatch)
    return not mismatch


def run_self_check() -> str | None:
    """The loop against torch's kernel (:mod:`optimizer_node.update.kernels.self_check`): the first
    difference found, or ``None``; compiles the loop if numba's cache lacks it."""
    from optimizer_node.update.kernels.self_check import self_check

    return self_check(update, lambda values, out: _kernels().cast_bf16(values.numpy(), _array(out)))
