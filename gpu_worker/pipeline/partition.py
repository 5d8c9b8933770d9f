"""Where to cut: per-block costs from a short calibration, and stages balanced on them.

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
from dataclasses import dataclass

import torch

from gpu_worker.pipeline.blocks import PipelineBlock


@dataclass(frozen=True)
class BlockCost:
    """What one block costs for one micro-batch."""

    forward_s: float
    backward_s: float
    output_bytes: int
    param_bytes: int
    saved_bytes: int

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s


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


def balance(costs: Sequence[BlockCost], num_stages: int, *, max_stage_bytes: int | None = None, in_flight: int = 1) -> list[int]:
    """Cut points (first block of stages 1..P-1) minimizing the slowest stage's compute time.

    With ``max_stage_bytes``, a stage's parameters plus ``in_flight`` micro-batches of saved
    activations must fit in it; ``ValueError`` when no split does.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} blocks into {num_stages} stages: each stage needs at least one block")
    prefix_time = [0.0]
    prefix_bytes = [0]
    for cost in costs:
        prefix_time.append(prefix_time[-1] + cost.compute_s)
        prefix_bytes.append(prefix_bytes[-1] + cost.param_bytes + in_flight * cost.saved_bytes)

    def fits(a: int, b: int) -> bool:
        return max_stage_bytes is None or prefix_bytes[b] - prefix_bytes[a] <= max_stage_bytes

    inf = float("inf")
    # best[s][i]: the slowest stage of the best split of blocks [0, i) into s stages; classic linear partition
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                if best[s - 1][j] == inf or not fits(j, i):
                    continue
                worst = max(best[s - 1][j], prefix_time[i] - prefix_time[j])
                if worst < best[s][i]:
                    best[s][i], choice[s][i] = worst, j
    if best[num_stages][n] == inf:
        need = max(c.param_bytes + in_flight * c.saved_bytes for c in costs)
        raise ValueError(
            f"no split of {n} blocks into {num_stages} stages fits {max_stage_bytes} bytes per stage "
            f"(the largest block alone needs {need}): use more stages, smaller micro-batches, or more memory"
        )
    cuts = []
    i = n
    for s in range(num_stages, 1, -1):
        i = choice[s][i]
        cuts.append(i)
    return sorted(cuts)
