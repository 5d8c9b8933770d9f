"""Benchmarks behind ``netoptim bench``: each measures netoptim and a baseline in the same run and
prints one JSON object with a top-level ``ratio`` (netoptim over baseline; higher is better)."""

from __future__ import annotations

import argparse
import json
import sys


def run_benchmark(args: argparse.Namespace) -> int:
    plot = getattr(args, "plot", "")
    if plot:
        from netoptim.benchmarks.plot import PlotUnavailable, check_available

        try:
            check_available()  # before the benchmark runs for nothing
        except PlotUnavailable as exc:
            print(f"netoptim bench {args.bench}: {exc}", file=sys.stderr)
            return 2
    if args.bench == "optimizer" and getattr(args, "rule", "adamw") != "adamw":
        from netoptim.benchmarks.node.rule_bench import run
    elif args.bench == "optimizer":
        from netoptim.benchmarks.node.optimizer_bench import run
    elif args.bench == "transport":
        from netoptim.benchmarks.transport_bench import run
    elif args.bench == "offload":
        from netoptim.benchmarks.node.offload_bench import run
    elif args.bench == "gpu":
        from netoptim.benchmarks.gpu.bench import run
    elif args.bench == "train":
        from netoptim.benchmarks.train_bench import run
    elif args.bench == "plan":
        from netoptim.benchmarks.plan_bench import run
    elif args.bench == "cost":
        from netoptim.benchmarks.cost_bench import run
    elif args.bench == "step":
        from netoptim.benchmarks.node.step_bench import run
    elif args.bench == "cluster":
        from netoptim.benchmarks.cluster_bench import run
    elif args.bench == "morph":
        from netoptim.benchmarks.morph_bench import run
    elif args.bench == "convergence":
        from netoptim.benchmarks.convergence_bench import run
    else:
        raise AssertionError(args.bench)
    try:
        result = run(args)
    except ValueError as exc:  # a setting this machine or these flags cannot run: said, as a usage error
        print(f"netoptim bench {args.bench}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    if plot:
        from netoptim.benchmarks.plot import plot_result

        print(f"netoptim bench {args.bench}: comparison drawn in {plot_result(args.bench, result, plot)}", file=sys.stderr)
    return 0
