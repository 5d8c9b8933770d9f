"""``netoptim bench optimizer``: the node's update rate against torch's fused AdamW in the same run.

The node's work per bucket is what ``NodeDaemon`` does for it: sum the W workers' gradients in rank
order (arriving in the wire dtype), apply AdamW with the fused kernel, and produce the outgoing copy
in the wire dtype. The baseline is ``torch.optim.AdamW(fused=True)`` stepping the same number of
parameters, with the averaged gradient already in place (it sums nothing and sends nothing).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import median_seconds, memory_bandwidth_gbs
from optimizer_node.adamw import AdamWHyper, adamw_update
from optimizer_node.reduce import OrderedReduction

BUCKET_NUMEL = 1 << 20


def node_bytes_per_param(workers: int, wire_bytes: int) -> int:
    """Memory traffic of the node's update per parameter: the gradient sum reads every worker's
    gradient and writes the sum (rank 0's frame is adopted as the accumulator when it is fp32), AdamW
    reads and writes param, exp_avg, exp_avg_sq and reads the gradient, and a non-fp32 wire adds the cast."""
    adopt = wire_bytes == 4
    summing = workers * wire_bytes + 4 * (workers - 1 if adopt else workers)
    adam = 4 * 7
    cast = 0 if wire_bytes == 4 else 4 + wire_bytes
    return summing + adam + cast


def run(args: argparse.Namespace) -> dict:
    wire_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.wire_dtype]
    num_buckets = max(1, args.numel // BUCKET_NUMEL)
    sizes = [BUCKET_NUMEL] * num_buckets
    numel = sum(sizes)
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=generator) for n in sizes]
    exp_avgs = [torch.zeros(n) for n in sizes]
    exp_avg_sqs = [torch.zeros(n) for n in sizes]
    steps = [torch.zeros(()) for _ in sizes]
    scratch = [torch.empty(n) for n in sizes]
    wire_out = [torch.empty(n, dtype=wire_dtype) for n in sizes] if wire_dtype != torch.float32 else None
    originals = [[torch.randn(n, generator=generator).to(wire_dtype) for _ in range(args.workers)] for n in sizes]
    frames = [[g.clone() for g in per_bucket] for per_bucket in originals]  # what arrived; rank 0's is consumed
    hyper = AdamWHyper(1e-4, 0.9, 0.999, 1e-8, 0.01)
    divisor = torch.tensor(float(args.workers))

    def refresh_frames() -> None:  # each step receives new frames; restoring them is not the node's work
        for fresh, original in zip(frames, originals, strict=True):
            fresh[0].copy_(original[0])

    def node_update() -> None:
        for index in range(num_buckets):
            reduction = OrderedReduction(sizes[index], args.workers, lambda index=index: scratch[index])
            for rank in reversed(range(args.workers)):  # worst arrival order: all but the last are held
                reduction.add(rank, [(0, frames[index][rank])])
            adamw_update(params[index], reduction.result, exp_avgs[index], exp_avg_sqs[index], steps[index], hyper, grad_divisor=divisor)
            if wire_out is not None:
                wire_out[index].copy_(params[index])

    baseline_params = [torch.nn.Parameter(p.clone()) for p in params]
    for p, per_bucket in zip(baseline_params, originals, strict=True):
        p.grad = per_bucket[0].float()
    fused = torch.optim.AdamW(baseline_params, lr=1e-4, weight_decay=0.01, fused=True)

    node_s = median_seconds(node_update, args.repeats, setup=refresh_frames, label="node update")
    fused_s = median_seconds(fused.step, args.repeats, label="torch fused AdamW")
    bandwidth = memory_bandwidth_gbs(args.repeats)
    node_rate, fused_rate = numel / node_s / 1e6, numel / fused_s / 1e6
    bytes_per_param = node_bytes_per_param(args.workers, wire_dtype.itemsize)
    return {
        "benchmark": "optimizer",
        "ratio": round(node_rate / fused_rate, 3),
        "numel": numel,
        "workers": args.workers,
        "wire_dtype": args.wire_dtype,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "node_mparams_per_s": round(node_rate, 1),
        "torch_fused_adamw_mparams_per_s": round(fused_rate, 1),
        "memory_bandwidth_gbs": round(bandwidth, 1),
        "node_bytes_per_param": bytes_per_param,
        "node_bandwidth_bound_mparams_per_s": round(bandwidth * 1e3 / bytes_per_param, 1),
        "fused_adamw_bandwidth_bound_mparams_per_s": round(bandwidth * 1e3 / 28, 1),
    }
