"""Per-block costs from a short calibration on this worker; :mod:`gpu_worker.pipeline.balance` balances
stages on them.

The calibration runs each block's forward and backward on a sample micro-batch, alone and in order
(each block's input is the previous block's output), and records the median time of each, the bytes
of its output (what a stage boundary sends), of its parameters, and of the activations autograd
saves for backward (what a stage holds per micro-batch in flight).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Sequence

import torch

from gpu_worker.pipeline.balance import BlockCost
from gpu_worker.pipeline.blocks import PipelineBlock


def calibrate(blocks: Sequence[PipelineBlock], sample: torch.Tensor, *, repeats: int = 3) -> list[BlockCost]:
    """Measure every block on ``sample`` (a micro-batch of model inputs); medians of ``repeats`` runs
    after one warm-up. Parameters' gradients are left as they were."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    grads_before = [[p.grad for p in block.module.parameters()] for block in blocks]
    costs = []
    x = sample
    for block in blocks:
        # Autograd also saves the weights it multiplies by; they are the parameters, not new memory.
        param_storages = {p.untyped_storage().data_ptr() for p in block.module.parameters()}
        forward_times, backward_times = [], []
        saved = 0
        for attempt in range(repeats + 1):
            inputs = x.detach().requires_grad_(x.is_floating_point())
            saved_now = 0

            def pack(tensor: torch.Tensor, param_storages: set[int] = param_storages) -> torch.Tensor:
                nonlocal saved_now
                if tensor.untyped_storage().data_ptr() not in param_storages:
                    saved_now += tensor.numel() * tensor.element_size()
                return tensor

            # The warm-up run counts the saved bytes; the timed runs go without the hook's overhead.
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if attempt == 0 else contextlib.nullcontext()
            started = time.perf_counter()
            with hooks:
                out = block.module(inputs)
            forwarded = time.perf_counter()
            torch.autograd.backward(out, torch.ones_like(out))
            done = time.perf_counter()
            if attempt:  # the first run warms up allocators and kernels
                forward_times.append(forwarded - started)
                backward_times.append(done - forwarded)
            else:
                saved = saved_now
        param_bytes = sum(p.numel() * p.element_size() for p in block.module.parameters())
        costs.append(BlockCost(statistics.median(forward_times), statistics.median(backward_times), out.numel() * out.element_size(), param_bytes, saved))
        x = out.detach()
    for block, before in zip(blocks, grads_before, strict=True):
        for param, grad in zip(block.module.parameters(), before, strict=True):
            param.grad = grad
    return costs
