"""The 8-bit dynamic map of Dettmers et al. (*8-bit Optimizers via Block-wise Quantization*, 2022):
256 values in [-1, 1] (signed, for the first moment) or [0, 1] (unsigned, for the second), dense near
zero and sparse near one, and the rounding of a scaled value to the nearest of them.

The values are built as the paper's reference code builds them in fp32 (per decade ``10**(i - 6)``,
the midpoints of an fp32 ``linspace(0.1, 1, ...)``), so a state quantized here has the codes that
torchao's and bitsandbytes' 8-bit optimizers give the same values (the tests compare).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

EXPONENT_BITS = 7
"""Decades the map spans: its smallest nonzero magnitude is about ``1e-7``."""


@functools.cache
def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 map values, ascending, fp32 (a tensor shared by every caller: do not write to it)."""
    values: list[float] = [0.0, 1.0]
    for decade in range(EXPONENT_BITS):
        # signed: one bit of the 8 is the sign, so each decade has half the steps
        steps = 2**decade if signed else 2 ** (decade + 1)
        bounds = torch.linspace(0.1, 1, steps + 1)
        midpoints = (bounds[:-1] + bounds[1:]) / 2.0
        magnitude = 10.0 ** (decade - (EXPONENT_BITS - 1))
        values += (magnitude * midpoints).tolist()
        if signed:
            values += (-magnitude * midpoints).tolist()
    if len(values) != 256:
        raise AssertionError(f"the dynamic map has {len(values)} values, not 256")
    return torch.tensor(sorted(values), dtype=torch.float32)


@functools.cache
def floor_table(signed: bool) -> np.ndarray:
    """For each of the 65,536 upper halves of an fp32's bits, the code of the largest map value at or
    below the smallest fp32 with those upper bits (0 below the map, and for NaN): where a value's
    search starts. At most one map value lies above that start within one upper half (checked here:
    the compiled rounding takes one step)."""
    qmap = dynamic_map(signed).numpy()
    upper = np.arange(65536, dtype=np.uint32) << np.uint32(16)
    negative = (upper & np.uint32(0x80000000)) != 0
    smallest = np.where(negative, upper | np.uint32(0xFFFF), upper).view(np.float32)  # the most negative of a negative half
    with np.errstate(invalid="ignore"):
        codes = np.searchsorted(qmap, smallest, side="right").astype(np.int64) - 1
    codes = np.clip(codes, 0, 255)
    codes[np.isnan(smallest)] = 0
    largest = np.where(negative, upper, upper | np.uint32(0xFFFF)).view(np.float32)
    with np.errstate(invalid="ignore"):
        last = np.clip(np.searchsorted(qmap, largest, side="right").astype(np.int64) - 1, 0, 255)
    steps = (last - codes)[~np.isnan(largest)]
    if steps.max() > 1:
        raise AssertionError(f"an upper half of the fp32 bits spans {steps.max()} map values: the one-step search would round wrongly")
    return codes.astype(np.uint8)


def quantize(scaled: torch.Tensor, signed: bool) -> torch.Tensor:
    """The codes (uint8) of ``scaled`` (values in [-1, 1]): the largest map value at or below each
    (the first for values below the map, and for NaN), moved up one where the value is at least
    halfway to the next."""
    qmap = dynamic_map(signed)
    codes = torch.zeros(scaled.shape, dtype=torch.int64)
    for bit in (128, 64, 32, 16, 8, 4, 2, 1):  # a branchless binary search: NaN compares false throughout
        codes += torch.where(scaled >= qmap[codes + bit], bit, 0)
    above = (codes + 1).clamp_(max=255)
    below_value = qmap[codes]
    halfway = (qmap[above] - below_value) * 0.5
    return torch.where(scaled - below_value >= halfway, above, codes).to(torch.uint8)


def dequantize(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    """The map values of ``codes`` (fp32), before the block's scale."""
    return dynamic_map(signed)[codes.to(torch.int64)]
