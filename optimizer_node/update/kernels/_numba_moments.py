"""The compiled update of compressed moments (numba; imported on first use by
:mod:`optimizer_node.update.kernels.moment_update`): for each piece of the compressed segments, the
moments are decoded into a per-thread fp32 scratch, updated with the arithmetic of
:mod:`optimizer_node.update.kernels._numba_kernels` (torch's fused AdamW, operation by operation),
and encoded again while the piece is in cache: the memory traffic is the compressed bytes.

8 bits: the block's scale is the absmax of its new values (at least ``SCALE_FLOOR``, NaN if one is
NaN, as torch's ``amax`` and ``clamp``); each value divided by it is rounded to the nearest map value
as the reference's branchless binary search rounds (ties up), the search started from a table on the
upper 16 bits of the fp32 (one step instead of eight, and no branch).
"""

from __future__ import annotations

import math

import numpy as np
from numba import get_thread_id, prange

from optimizer_node.moments.dynamic_map import dynamic_map, floor_table
from optimizer_node.update.kernels._numba_kernels import _as_bits, _as_float, _fma, _jit, _to_bf16, _widen

SCALE_FLOOR = np.float32(1e-12)


# The maps and their search tables as module constants, which numba compiles in: LLVM then knows
# the loops' stores cannot change them and vectorizes their reads (as arguments they kept the decode
# and the rounding scalar). They are fixed by the format (optimizer_node.moments.dynamic_map).
QMAP_SIGNED = dynamic_map(True).numpy().copy()
QMAP_UNSIGNED = dynamic_map(False).numpy().copy()
TABLE_SIGNED = floor_table(True).copy()
TABLE_UNSIGNED = floor_table(False).copy()


@_jit(inline="always")
def _round_to(y, qmap, table):  # pragma: no cover - compiled
    """The map code of the scaled value ``y``: the largest map value at or below it (0 below the
    map and for NaN), one up where ``y`` is at least halfway to the next. The table's start is at
    most one map value below the answer (``floor_table`` checks that when it is built)."""
    c = np.int32(table[_as_bits(y) >> np.uint32(16)])
    # selects spelled as arithmetic: as conditionals LLVM made them branches, which random moments
    # mispredict half the time (3.5x slower measured)
    c = c + np.int32(c < 255 and qmap[min(c + np.int32(1), np.int32(255))] <= y)
    up = min(c + np.int32(1), np.int32(255))
    low = qmap[c]
    c = c + np.int32(y - low >= (qmap[up] - low) * np.float32(0.5)) * (up - c)
    return np.uint8(c)


@_jit(inline="always")
def _code_signed(y):  # pragma: no cover - compiled
    return _round_to(y, QMAP_SIGNED, TABLE_SIGNED)


@_jit(inline="always")
def _code_unsigned(y):  # pragma: no cover - compiled
    return _round_to(y, QMAP_UNSIGNED, TABLE_UNSIGNED)


@_jit(inline="always")
def _scale_of(values, n):  # pragma: no cover - compiled
    """The block's scale: the largest magnitude of ``values[:n]``, at least ``SCALE_FLOOR``, NaN where
    one is NaN (torch's ``amax`` and ``clamp``). Taken as the largest of the magnitudes' bit patterns,
    which order as the magnitudes do, NaN's above infinity's: an integer maximum, which vectorizes."""
    top = np.uint32(0)
    for i in range(n):
        top = max(top, _as_bits(values[i]) & np.uint32(0x7FFFFFFF))
    if top > np.uint32(0x7F800000):
        return np.float32(np.nan)
    amax = _as_float(top)
    return amax if amax > SCALE_FLOOR else SCALE_FLOOR


@_jit(inline="always")
def _step(p, m, v, grad, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step):  # pragma: no cover - compiled
    """One element's AdamW from its old values: (new parameter, new m, new v), the arithmetic of
    ``_numba_kernels._adamw_into`` operation by operation (the self-check holds them bitwise equal)."""
    base = m if lerp_from_m else grad
    mi = _fma(coeff, grad - m, base)
    vi = _fma(one_minus_beta2 * grad, grad, v * beta2)
    return p * decay + (neg_step * mi) / (math.sqrt(vi) / bias2_sqrt + eps), mi, vi


@_jit(parallel=True)
def update_8bit(
    p, a, b, pair, mc, ms, vc, vs, rows, block, scratch,
    scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step,
):  # pragma: no cover - compiled  # fmt: skip
    """AdamW on the 8-bit rows ``(bucket offset, compressed index, length)``, ``p`` in place,
    gradient ``a`` (+ ``b`` with ``pair``) divided by ``scale``; ``mc``/``vc`` codes, ``ms``/``vs``
    scales, indexed by the compressed index (a block per row). Three loops a block, each one that
    vectorizes: decode and update (the new moments to the thread's scratch), the new scales, encode."""
    for r in prange(rows.shape[0]):
        off = rows[r, 0]
        at = rows[r, 1]
        n = rows[r, 2]
        k = at // block
        m = scratch[get_thread_id(), 0]
        v = scratch[get_thread_id(), 1]
        pp = p[off : off + n]
        aa = a[off : off + n]
        bb = b[off : off + n]
        mm = mc[at : at + n]
        vv = vc[at : at + n]
        m_scale = ms[k]
        v_scale = vs[k]
        for i in range(n):  # decoded first: a loop of table reads stays scalar, the update's does not
            m[i] = QMAP_SIGNED[mm[i]] * m_scale
            v[i] = QMAP_UNSIGNED[vv[i]] * v_scale
        if pair:
            for i in range(n):
                pp[i], m[i], v[i] = _step(
                    pp[i], m[i], v[i], (aa[i] + bb[i]) / scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step
                )
        else:
            for i in range(n):
                pp[i], m[i], v[i] = _step(pp[i], m[i], v[i], aa[i] / scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step)
        m_scale = _scale_of(m, n)
        v_scale = _scale_of(v, n)
        ms[k] = m_scale
        vs[k] = v_scale
        for i in range(n):
            mm[i] = _code_signed(m[i] / m_scale)
            vv[i] = _code_unsigned(v[i] / v_scale)


@_jit(parallel=True)
def update_bf16_moments(
    p, a, b, pair, mc, vc, rows,
    scale, decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step,
):  # pragma: no cover - compiled  # fmt: skip
    """AdamW on the bf16 rows ``(bucket offset, compressed index, length)``, ``p`` in place;
    ``mc``/``vc`` the bf16 bits (uint16), widened exactly and rounded to nearest even when stored:
    one elementwise loop (over slices indexed by the loop's own counter, which numba knows is not
    negative: an index it must wrap would keep the loop scalar)."""
    for r in prange(rows.shape[0]):
        off = rows[r, 0]
        at = rows[r, 1]
        n = rows[r, 2]
        pp = p[off : off + n]
        aa = a[off : off + n]
        bb = b[off : off + n]
        mm = mc[at : at + n]
        vv = vc[at : at + n]
        if pair:
            for i in range(n):
                new, mi, vi = _step(
                    pp[i], _widen(mm[i]), _widen(vv[i]), (aa[i] + bb[i]) / scale,
                    decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step,
                )  # fmt: skip
                pp[i] = new
                mm[i] = _to_bf16(mi)
                vv[i] = _to_bf16(vi)
        else:
            for i in range(n):
                new, mi, vi = _step(
                    pp[i], _widen(mm[i]), _widen(vv[i]), aa[i] / scale,
                    decay, coeff, lerp_from_m, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step,
                )  # fmt: skip
                pp[i] = new
                mm[i] = _to_bf16(mi)
                vv[i] = _to_bf16(vi)
