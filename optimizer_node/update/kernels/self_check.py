"""The compiled loop's check against torch's fused AdamW, run once per build and CPU before a node
uses the loop (:func:`optimizer_node.update.kernels.compiled_update.usable`): both lerp branches, with and without
weight decay, fp32 and bf16 frames, a partial sum, the serial and parallel loops, the new values
written beside the ones read, the decay factor's rounding and the bf16 cast of special values. A
change to this file runs the check again (it is part of the recorded verdict's fingerprint)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from optimizer_node.update.adamw import AdamWHyper


def self_check(update: Callable[..., None], cast_bf16: Callable[[torch.Tensor, torch.Tensor], None]) -> str | None:
    """Run the loop (``update``: :func:`optimizer_node.update.kernels.compiled_update.update`; ``cast_bf16``: its
    cast of fp32 values into a bf16 tensor) and torch's kernel on the same inputs; the first
    difference found, or ``None``."""
    generator = torch.Generator().manual_seed(0)
    cases = [  # both lerp branches, with and without weight decay; fp32 frames, bf16 frames, bf16 after a partial sum
        (AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.01), torch.float32, 2),
        (AdamWHyper(3e-2, 0.3, 0.5, 1e-6, 0.0), torch.bfloat16, 2),
        (AdamWHyper(1e-2, 0.8, 0.99, 1e-7, 0.1), torch.bfloat16, 3),
    ]
    for hyper, dtype, workers in cases:
        if (mismatch := _check_case(update, hyper, dtype, workers, generator)) is not None:
            return mismatch
    if (mismatch := _check_decay_rounding(update)) is not None:
        return mismatch
    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 3.4e38, -0.0, 1e-40, 1.00390625, 1.01171875, -1.00390625])
    values = torch.cat([special, torch.randn(1000, generator=generator) * torch.exp(20 * torch.randn(1000, generator=generator))])
    cast = torch.empty(values.numel(), dtype=torch.bfloat16)
    cast_bf16(values, cast)
    if not torch.equal(cast.view(torch.int16), values.to(torch.bfloat16).view(torch.int16)):
        return "the bf16 cast"
    return None


def _check_decay_rounding(update: Callable[..., None], numel: int = 64) -> str | None:
    """lr * weight_decay == 1 with gradients whose square overflows: the update term vanishes and the
    parameters are the decay factor times themselves, so its rounding shows in every element."""
    hyper = AdamWHyper(10.0, 0.0, 0.999, 1e-8, 0.1)
    generator = torch.Generator().manual_seed(1)
    mine = [torch.randn(numel, generator=generator), torch.zeros(numel), torch.zeros(numel)]
    theirs = [t.clone() for t in mine]
    grad = torch.randn(numel, generator=generator) * 1e37
    step = torch.ones(())
    torch._fused_adamw_(
        [theirs[0]], [grad.clone()], [theirs[1]], [theirs[2]], [], [step], lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
        weight_decay=hyper.weight_decay, eps=hyper.eps, amsgrad=False, maximize=False, grad_scale=torch.tensor(1.0), found_inf=None,
    )  # fmt: skip
    blocks = np.array([[0, numel]], dtype=np.int64)
    update(mine[0], mine[1], mine[2], None, [grad], None, blocks, hyper, 1.0, 1.0, None, serial=True)
    return None if torch.equal(mine[0], theirs[0]) else "the decay factor at lr * weight_decay == 1"


def _check_case(update: Callable[..., None], hyper: AdamWHyper, dtype: torch.dtype, workers: int, generator: torch.Generator, numel: int = 4096) -> str | None:
    blocks = np.array([[0, 1000], [1000, numel]], dtype=np.int64)
    wire = torch.empty(numel, dtype=torch.bfloat16) if dtype == torch.bfloat16 else None
    mine = [torch.randn(numel, generator=generator), torch.randn(numel, generator=generator), torch.rand(numel, generator=generator)]
    mine[0][:64] = 0.0
    theirs = [t.clone() for t in mine]
    step = torch.zeros(())
    for index in range(3):
        # magnitudes over many orders, and zeros
        grads = [(torch.randn(numel, generator=generator) * torch.exp(4 * torch.randn(numel, generator=generator))).to(dtype) for _ in range(workers)]
        grads[0][64:128] = 0
        total = grads[0].float()
        for grad in grads[1:]:
            total = total + grad.float()
        head = None
        frames = grads
        if dtype == torch.bfloat16 and workers > 2:  # a partial sum in fp32, then bf16 frames
            head, frames = grads[0].float() + grads[1].float(), grads[2:]
        step.add_(1 if index < 2 else 997)  # a late step too: the bias corrections' powers
        torch._fused_adamw_(
            [theirs[0]], [total], [theirs[1]], [theirs[2]], [], [step], lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
            weight_decay=hyper.weight_decay, eps=hyper.eps, amsgrad=False, maximize=False, grad_scale=torch.tensor(float(workers)), found_inf=None,
        )  # fmt: skip
        before = mine[0].clone()
        previous = torch.empty(numel)
        # the serial loop, the parallel one and the one chosen here; in fp32 the second writes the new
        # values elsewhere (keep), as onto a parameter board's other slot
        keep = dtype == torch.float32 and index == 1
        out = torch.empty(numel) if keep else wire
        update(mine[0], mine[1], mine[2], head, frames, out, blocks, hyper, float(step), float(workers), previous, serial=(True, False, None)[index], keep=keep)
        if not torch.equal(previous, before):
            return f"the kept parameters at step {int(step)}"
        if keep and out is not None:
            if not torch.equal(mine[0], before):
                return f"the source of an update elsewhere changed at step {int(step)}"
            mine[0] = out
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), mine, theirs, strict=True):
            if not torch.equal(a, b):
                return f"{name} at step {int(step)}, {dtype} gradients of {workers} workers, {hyper}"
        if wire is not None and not torch.equal(wire, theirs[0].to(torch.bfloat16)):
            return f"the bf16 copy at step {int(step)}"
    return None
