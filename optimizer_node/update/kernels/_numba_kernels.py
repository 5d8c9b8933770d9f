"""The compiled loop's numba functions, and the NaN/inf count's (imported by :mod:`optimizer_node.update.kernels.compiled_update` on first
use, so that importing the node does not import numba). Only exact IEEE fp32 arithmetic: no
fast-math, hence no contraction or reassociation that the source does not spell out.

A block of a bucket is updated by one loop that reads the last gradient term (and the sum of the
others, or the first term when there are two) straight from memory, so the memory reads of the sum
and of AdamW overlap as in torch's own kernel; bf16 terms are widened in the loop (exact: the bf16
bits are the high half of the fp32 ones).
"""

from __future__ import annotations

import math
import platform

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload


def _jit(**options):
    """``njit`` with exact IEEE arithmetic (no fast-math: no contraction, no reassociation)."""
    return njit(fastmath=False, boundscheck=False, error_model="numpy", nogil=True, cache=True, **options)


@intrinsic
def _fma(typingctx, a, b, c):
    """fp32 ``a * b + c`` with one rounding: torch's ``vec::fmadd``."""
    signature = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, sig, args):
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.FloatType(), [ir.FloatType()] * 3), "llvm.fma.f32")
        return builder.call(function, args)

    return signature, codegen


@intrinsic
def _as_float(typingctx, bits):
    """The fp32 whose bits are ``bits`` (uint32)."""
    return types.float32(types.uint32), lambda context, builder, sig, args: builder.bitcast(args[0], ir.FloatType())


@intrinsic
def _as_bits(typingctx, value):
    """The bits (uint32) of the fp32 ``value``."""
    return types.uint32(types.float32), lambda context, builder, sig, args: builder.bitcast(args[0], ir.IntType(32))


_VECTOR = 8  # fp32 lanes of one streaming store: 32 bytes, an AVX register (two SSE ones)
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


@intrinsic
def _stream_store(typingctx, src, dst, i):
    """``dst[i : i + 8] = src[i : i + 8]`` with a non-temporal store (``dst`` 32-byte aligned at ``i``):
    the line goes to memory without being read first (no write-allocate) and without evicting the
    cache the update works in."""
    signature = types.void(src, dst, types.intp)

    def codegen(context, builder, sig, args):
        vector = ir.VectorType(ir.FloatType(), _VECTOR)
        source = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0]).data
        target = cgutils.create_struct_proxy(sig.args[1])(context, builder, value=args[1]).data
        values = builder.load(builder.bitcast(builder.gep(source, [args[2]]), vector.as_pointer()), align=4)
        store = builder.store(values, builder.bitcast(builder.gep(target, [args[2]]), vector.as_pointer()), align=4 * _VECTOR)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def _store_fence(typingctx):
    """Order the streaming stores before whatever follows (they are weakly ordered): ``sfence`` on
    x86, a full fence elsewhere."""

    def codegen(context, builder, sig, args):
        if _X86:
            builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse.sfence"), [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@_jit()
def stream_copy(p, out):  # pragma: no cover - compiled
    """``out`` = ``p`` (fp32), the aligned body in streaming stores: a copy nobody on this host reads
    soon (the parameter board, read by a GPU's DMA; the values kept for a restarted rank) costs its
    write only, not a read of the target's lines first."""
    n = p.shape[0]
    head = min(n, ((4 * _VECTOR - out.ctypes.data % (4 * _VECTOR)) % (4 * _VECTOR)) // 4)
    for i in range(head):
        out[i] = p[i]
    i = head
    while i + _VECTOR <= n:
        _stream_store(p, out, i)
        i += _VECTOR
    for k in range(i, n):
        out[k] = p[k]
    _store_fence()


@_jit(inline="always")
def _widen(raw):  # pragma: no cover - compiled
    """bf16 bits (uint16) to fp32, exactly."""
    return _as_float(np.uint32(raw) << np.uint32(16))


@_jit(inline="always")
def _adamw_into(p, out, m, v, i, grad, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step):  # pragma: no cover - compiled
    """Element ``i``, with its averaged gradient: the vector path of torch's fp32 AdamW kernel, operation
    by operation, the parameter read from ``p`` and the new one written to ``out``; returns it."""
    old = m[i]
    base = old if lerp_from_m else grad  # exp_avg.lerp_(grad, w): |w| < 0.5 ? m + w*(g-m) : g + (w-1)*(g-m)
    mi = _fma(coeff, grad - old, base)
    vi = _fma(one_minus_beta2 * grad, grad, v[i] * beta2)  # the multiply-add torch's build fuses
    m[i] = mi
    v[i] = vi
    new = p[i] * decay + (neg_step * mi) / (math.sqrt(vi) / bias2_sqrt + eps)
    out[i] = new
    return new


@_jit(inline="always")
def _adamw(p, m, v, i, grad, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step):  # pragma: no cover - compiled
    """:func:`_adamw_into` in place."""
    return _adamw_into(p, p, m, v, i, grad, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step)


@_jit(inline="always")
def _to_bf16(value):  # pragma: no cover - compiled
    """fp32 to bf16 bits as torch's ``copy_`` rounds: to nearest even, NaN as 0xFFFF."""
    u = _as_bits(value)
    rounded = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    return np.uint16(0xFFFF) if value != value else rounded


@_jit()
def _pair_fp32(p, m, v, a, b, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step):  # pragma: no cover
    for i in range(p.shape[0]):
        _adamw(p, m, v, i, (a[i] + b[i]) / scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step)


@_jit()
def _pair_mixed(p, m, v, a, b, wire, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step):  # pragma: no cover
    if wire.shape[0] > 0:  # the outgoing bf16 copy in the same loop
        for i in range(p.shape[0]):
            wire[i] = _to_bf16(_adamw(p, m, v, i, (a[i] + _widen(b[i])) / scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step))
    else:
        for i in range(p.shape[0]):
            _adamw(p, m, v, i, (a[i] + _widen(b[i])) / scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step)


@_jit()
def _pair_bf16(p, m, v, a, b, wire, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step):  # pragma: no cover
    if wire.shape[0] > 0:  # the outgoing bf16 copy in the same loop
        for i in range(p.shape[0]):
            wire[i] = _to_bf16(
                _adamw(p, m, v, i, (_widen(a[i]) + _widen(b[i])) / scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step)
            )
    else:
        for i in range(p.shape[0]):
            _adamw(p, m, v, i, (_widen(a[i]) + _widen(b[i])) / scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step)


@_jit()
def _single_fp32(p, m, v, a, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step):  # pragma: no cover
    for i in range(p.shape[0]):
        _adamw(p, m, v, i, a[i] / scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step)


@_jit()
def _single_fp32_into(p, out, m, v, a, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step):  # pragma: no cover
    for i in range(p.shape[0]):
        _adamw_into(p, out, m, v, i, a[i] / scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step)


@_jit()
def _pair_fp32_into(p, out, m, v, a, b, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step):  # pragma: no cover
    for i in range(p.shape[0]):
        _adamw_into(p, out, m, v, i, (a[i] + b[i]) / scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step)


@_jit()
def _single_bf16(p, m, v, a, wire, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step):  # pragma: no cover
    if wire.shape[0] > 0:  # the outgoing bf16 copy in the same loop
        for i in range(p.shape[0]):
            wire[i] = _to_bf16(_adamw(p, m, v, i, _widen(a[i]) / scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step))
    else:
        for i in range(p.shape[0]):
            _adamw(p, m, v, i, _widen(a[i]) / scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step)


@_jit()
def cast_bf16(p, out):  # pragma: no cover - compiled
    """``out`` = ``p`` as bf16 bits, rounded as torch's ``copy_`` rounds: to nearest even, NaN as 0xFFFF."""
    for i in range(p.shape[0]):
        out[i] = _to_bf16(p[i])


def write_copy(p, out):  # pragma: no cover - compiled code calls the overload below
    """``out`` = ``p`` in ``out``'s dtype: bf16 bits (uint16), or fp32 as it is (a node's parameter board)."""
    if out.dtype == np.float32:
        out[:] = p
    else:
        cast_bf16(p, out)


@overload(write_copy, inline="always")
def _write_copy(p, out):  # pragma: no cover - compiled
    if out.dtype == types.float32:
        return lambda p, out: stream_copy(p, out)
    return lambda p, out: cast_bf16(p, out)


@_jit(inline="always")
def _terms_fp32(p, m, v, frames, lo, hi, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step):  # pragma: no cover
    """AdamW on ``p``, ``m``, ``v`` (the block's elements) with elements ``lo .. hi - 1`` of the fp32
    frames summed in order."""
    count = len(frames)
    last = frames[count - 1][lo:hi]
    if count == 1:
        _single_fp32(p, m, v, last, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step)
    else:
        if count == 2:
            rest = frames[0][lo:hi]
        else:  # the terms before the last, summed in order, then added to the last in the loop
            rest = frames[0][lo:hi].copy()  # (a constant index past a short tuple would not type)
            for k in range(1, count - 1):
                rest += frames[k][lo:hi]
        _pair_fp32(p, m, v, rest, last, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step)


# The in-place loops keep functions of their own rather than _adamw_into(p, p, ...): LLVM's vectorizer
# cannot prove two arguments are one array, checks at run time whether they overlap and, as they do,
# takes its scalar loop (_terms_fp32_into(p, p, ...) measured 3.2 ns an element in cache against
# _terms_fp32's 0.21, one gradient, one thread).
@_jit(inline="always")
def _terms_fp32_into(p, out, m, v, frames, lo, hi, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step):  # pragma: no cover
    """:func:`_terms_fp32` reading the parameters from ``p`` and writing the new ones to ``out``."""
    count = len(frames)
    last = frames[count - 1][lo:hi]
    if count == 1:
        _single_fp32_into(p, out, m, v, last, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step)
    else:
        if count == 2:
            rest = frames[0][lo:hi]
        else:
            rest = frames[0][lo:hi].copy()
            for k in range(1, count - 1):
                rest += frames[k][lo:hi]
        _pair_fp32_into(p, out, m, v, rest, last, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step)


@_jit(inline="always")
def _block_fp32(
    p, m, v, frames, wire, prev, work, lo, hi, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step
):  # pragma: no cover
    """Elements ``lo .. hi - 1``: (``prev`` not empty) the parameters kept as they were; AdamW with the
    fp32 frames summed in order; then (``wire`` not empty) the outgoing copy: bf16 bits, or fp32.
    ``work`` not empty (the caller's buffer of at least the block, with an fp32 ``wire``): ``p`` is
    only read; the block is updated in ``work``, which stays in cache, and goes to ``wire`` in
    streaming stores (the node's master values moving to the parameter board's other slot), so no
    byte of the block is written twice."""
    if prev.shape[0] > 0:  # the block is in cache for the update that follows
        stream_copy(p[lo:hi], prev[lo:hi])
    if work.shape[0] > 0:
        # The whole block, then its copy: with the streaming stores between the loop's loads (a
        # 4 KiB piece at a time) the pass ran 3-8% slower here, by all signs for the line buffers
        # the stores took from the loads.
        piece = work[: hi - lo]
        _terms_fp32_into(
            p[lo:hi], piece, m[lo:hi], v[lo:hi], frames, lo, hi, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step
        )
        write_copy(piece, wire[lo:hi])
    else:
        _terms_fp32(p[lo:hi], m[lo:hi], v[lo:hi], frames, lo, hi, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step)
        if wire.shape[0] > 0:  # the outgoing copy (bf16 bits or fp32) while the block is in cache
            write_copy(p[lo:hi], wire[lo:hi])


@_jit(inline="always")
def _block_bf16(
    p, m, v, head, frames, wire, prev, lo, hi, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step
):  # pragma: no cover
    """Elements ``lo .. hi - 1``: (``prev`` not empty) the parameters kept as they were; AdamW with the
    fp32 head (if not empty) and the bf16 frames summed in order, writing (``wire`` not empty) the bf16
    copy in the same loop."""
    count = len(frames)
    if prev.shape[0] > 0:  # the block is in cache for the update that follows
        stream_copy(p[lo:hi], prev[lo:hi])
    last = frames[count - 1][lo:hi]
    wire_block = wire[lo:hi] if wire.shape[0] > 0 else wire
    if head.shape[0] == 0 and count == 1:
        _single_bf16(p[lo:hi], m[lo:hi], v[lo:hi], last, wire_block, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step)
    elif head.shape[0] == 0 and count == 2:
        _pair_bf16(
            p[lo:hi],
            m[lo:hi],
            v[lo:hi],
            frames[0][lo:hi],
            last,
            wire_block,
            scale,
            decay,
            coeff,
            lerp_from_m,
            beta2,
            one_minus_beta2,
            bias2_sqrt,
            eps,
            neg_step,
        )
    else:  # the terms before the last, summed in order, then added to the last in the loop
        rest = np.empty(hi - lo, dtype=np.float32)
        first = 0
        if head.shape[0] > 0:
            rest[:] = head[lo:hi]
        else:
            _widen_into(rest, frames[0][lo:hi])
            first = 1
        for k in range(first, count - 1):
            _add_widened(rest, frames[k][lo:hi])
        _pair_mixed(p[lo:hi], m[lo:hi], v[lo:hi], rest, last, wire_block, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step)


# Each update comes twice: over the threads (numba's prange), and in this thread alone, for one
# thread or one block, where starting the thread pool costs more than the block (small buckets).


@_jit(inline="always")
def _work_numel(keep, blocks):  # pragma: no cover - compiled
    """With ``keep``, the elements of the largest block (at most 32K: its buffer stays in cache; one
    is made per thread and reused block after block, as one made per block came and went and the
    allocator gave its pages back and faulted them in again each time); else 0 (no buffer)."""
    widest = 0
    if keep:
        for b in range(blocks.shape[0]):
            widest = max(widest, blocks[b, 1] - blocks[b, 0])
    return widest


@_jit(parallel=True)
def update_fp32(
    p, m, v, frames, wire, prev, keep, blocks, threads, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step
):  # pragma: no cover
    """Each block (start, stop) of ``blocks``, over the ``threads`` (numba's count for the calling
    thread; read inside, the function could not be cached), an equal count of blocks each, as
    ``prange`` hands them out: see ``_block_fp32``."""
    count = blocks.shape[0]
    shares = min(count, threads)
    widest = _work_numel(keep, blocks)  # once, before the threads
    for share in prange(shares):
        work = np.empty(widest, dtype=np.float32)
        for b in range(share * count // shares, (share + 1) * count // shares):
            _block_fp32(
                p, m, v, frames, wire, prev, work, blocks[b, 0], blocks[b, 1],
                scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step,
            )  # fmt: skip


@_jit()
def update_fp32_serial(
    p, m, v, frames, wire, prev, keep, blocks, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step
):  # pragma: no cover
    """``update_fp32`` in the calling thread."""
    work = np.empty(_work_numel(keep, blocks), dtype=np.float32)
    for b in range(blocks.shape[0]):
        _block_fp32(
            p, m, v, frames, wire, prev, work, blocks[b, 0], blocks[b, 1], scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step
        )


@_jit(parallel=True)
def update_bf16(
    p, m, v, head, frames, wire, prev, blocks, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step
):  # pragma: no cover
    """Each block (start, stop) of ``blocks``, over the threads: see ``_block_bf16``."""
    for b in prange(blocks.shape[0]):
        _block_bf16(
            p, m, v, head, frames, wire, prev, blocks[b, 0], blocks[b, 1], scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step
        )


@_jit()
def update_bf16_serial(
    p, m, v, head, frames, wire, prev, blocks, scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step
):  # pragma: no cover
    """``update_bf16`` in the calling thread."""
    for b in range(blocks.shape[0]):
        _block_bf16(
            p, m, v, head, frames, wire, prev, blocks[b, 0], blocks[b, 1], scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step
        )


@_jit()
def _widen_into(out, raw):  # pragma: no cover - compiled
    for i in range(out.shape[0]):
        out[i] = _widen(raw[i])


@_jit()
def _add_widened(out, raw):  # pragma: no cover - compiled
    for i in range(out.shape[0]):
        out[i] += _widen(raw[i])


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
