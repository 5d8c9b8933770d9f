"""``netoptim bench optimizer --rule R``: the node's update of a rule other than AdamW (Adam, SGD,
SGD with Nesterov momentum, Lion) against torch's fused optimizer of the same rule, in the same run.

These rules take the node's per-piece path (:func:`~optimizer_node.update.bucket_pass.reduce_and_update_segments`):
the W workers' gradients summed in rank order into a scratch buffer, divided by W, then the rule's
kernel on the piece (torch's fused Adam or SGD; Lion in torch ops), with the outgoing copy cast for a
16-bit wire; each arrival is checked for NaN/inf first, as the daemon checks every push. The baseline steps the same parameters with the averaged gradient in place; torch has
no Lion, so Lion's baseline is ``torch.optim.AdamW(fused=True)``, the rule it replaces. ``ratio`` is
the median over interleaved rounds of the node's rate over the baseline's.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from netoptim.benchmarks.common import bucket_sizes, interleaved_seconds, median_ratio
from optimizer_node.intake.non_finite import count_non_finite
from optimizer_node.update.adamw import AdamWHyper
from optimizer_node.update.bucket_pass import reduce_and_update_segments
from optimizer_node.update.reduce import OrderedReduction

HYPERS = {
    "adam": AdamWHyper(1e-4, 0.9, 0.999, 1e-8, 0.01),
    "sgd": AdamWHyper(1e-3, 0.9, 0.0, 0.0, 0.01),
    "sgd-nesterov": AdamWHyper(1e-3, 0.9, 0.0, 0.0, 0.01),
    "lion": AdamWHyper(1e-4, 0.9, 0.99, 0.0, 0.1),
}


def baseline(rule: str, params: list[torch.nn.Parameter]) -> tuple[str, torch.optim.Optimizer]:
    hyper = HYPERS[rule]
    if rule == "adam":
        return "torch.optim.Adam(fused=True)", torch.optim.Adam(params, lr=hyper.lr, weight_decay=hyper.weight_decay, fused=True)
    if rule in ("sgd", "sgd-nesterov"):
        optimizer = torch.optim.SGD(params, lr=hyper.lr, momentum=hyper.beta1, weight_decay=hyper.weight_decay, nesterov=rule == "sgd-nesterov", fused=True)
        return f"torch.optim.SGD(fused=True, nesterov={rule == 'sgd-nesterov'})", optimizer
    return "torch.optim.AdamW(fused=True) (torch has no Lion)", torch.optim.AdamW(params, lr=hyper.lr, weight_decay=hyper.weight_decay, fused=True)


def run(args: argparse.Namespace) -> dict:
    rule = args.rule
    if rule not in HYPERS:
        raise ValueError(f"--rule {rule!r}: this benchmark measures {sorted(HYPERS)} (AdamW is the default benchmark)")
    if getattr(args, "moments", "fp32") != "fp32":
        raise ValueError(f"--moments {args.moments}: compressed moments are measured with --rule adamw, not {rule}")
    wire_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.wire_dtype]
    sizes = bucket_sizes(args.numel, args.bucket_numel)
    num_buckets, numel = len(sizes), args.numel
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=generator) for n in sizes]
    exp_avgs = [torch.zeros(n) for n in sizes]
    exp_avg_sqs = [torch.zeros(n) for n in sizes]
    steps = [torch.zeros(()) for _ in sizes]
    scratch = [torch.empty(n) for n in sizes]
    wire_out = [torch.empty(n, dtype=wire_dtype) for n in sizes] if wire_dtype != torch.float32 else None
    frames = [[torch.randn(n, generator=generator).to(wire_dtype) for _ in range(args.workers)] for n in sizes]
    divisor = torch.tensor(float(args.workers))
    hyper = HYPERS[rule]

    def node_update() -> None:
        for index in range(num_buckets):
            reduction = OrderedReduction(sizes[index], args.workers, lambda index=index: scratch[index], defer=True)
            for rank in reversed(range(args.workers)):
                pieces = [(0, frames[index][rank])]
                if count_non_finite(pieces):  # every push is checked, as the daemon does
                    raise AssertionError("the benchmark's gradients are finite")
                reduction.add(rank, pieces)
            reduce_and_update_segments(
                reduction,
                params[index],
                exp_avgs[index],
                exp_avg_sqs[index],
                [steps[index]],
                hyper,
                segments=[(0, sizes[index])],
                stepped=[True],
                rule=rule,
                grad_divisor=divisor,
                wire_out=None if wire_out is None else wire_out[index],
            )

    baseline_params = [torch.nn.Parameter(p.clone()) for p in params]
    for p, per_bucket in zip(baseline_params, frames, strict=True):
        p.grad = per_bucket[0].float()
    name, optimizer = baseline(rule, baseline_params)
    times = interleaved_seconds({"node": node_update, "baseline": optimizer.step}, args.repeats, label=f"node {rule} update and {name}")
    node_s, base_s = statistics.median(times["node"]), statistics.median(times["baseline"])
    return {
        "benchmark": "optimizer",
        "rule": rule,
        "ratio": round(median_ratio(times["baseline"], times["node"]), 3),
        "baseline": name,
        "numel": numel,
        "bucket_numel": args.bucket_numel,
        "buckets": num_buckets,
        "workers": args.workers,
        "wire_dtype": args.wire_dtype,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "node_mparams_per_s": round(numel / node_s / 1e6, 1),
        "baseline_mparams_per_s": round(numel / base_s / 1e6, 1),
    }
