"""Benchmarks behind ``netoptim bench``: each measures netoptim and a baseline in the same run and
prints one JSON object with a top-level ``ratio`` (netoptim over baseline; higher is better)."""

from __future__ import annotations

import argparse
import json


def run_benchmark(args: argparse.Namespace) -> int:
    if args.bench == "optimizer" and getattr(args, "rule", "adamw") != "adamw":
        from benchmarks.rule_bench import run
    elif args.bench == "optimizer":
        from benchmarks.optimizer_bench import run
    elif args.bench == "transport":
        from benchmarks.transport_bench import run
    elif args.bench == "offload":
        from benchmarks.offload_bench import run
    elif args.bench == "train":
        from benchmarks.train_bench import run
    elif args.bench == "plan":
        from benchmarks.plan_bench import run
    elif args.bench == "step":
        from benchmarks.step_bench import run
    elif args.bench == "cluster":
        from benchmarks.cluster_bench import run
    elif args.bench == "morph":
        from benchmarks.morph_bench import run
    else:
        raise AssertionError(args.bench)
    print(json.dumps(run(args), indent=2))
    return 0
