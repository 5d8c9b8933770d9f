"""Benchmarks behind ``netoptim bench``: each measures netoptim and a baseline in the same run and
prints one JSON object with a top-level ``ratio`` (netoptim over baseline; higher is better)."""

from __future__ import annotations

import argparse
import json
import sys


def run_benchmark(args: argparse.Namespace) -> int:
    plot = getattr(args, "plot", "")
    if plot:
        from benchmarks.plot import PlotUnavailable, check_available

        try:
            check_available()  # before the benchmark runs for nothing
        except PlotUnavailable as exc:
            print(f"netoptim bench {args.bench}: {exc}", file=sys.stderr)
            return 2
    if args.bench == "optimizer" and getattr(args, "rule", "adamw") != "adamw":
        from benchmarks.rule_bench import run
    elif args.bench == "optimizer":
        from benchmarks.optimizer_bench import run
    elif args.bench == "transport":
        from benchmarks.transport_bench import run
    elif args.bench == "offload":
        from benchmarks.offload_bench import run
    elif args.bench == "gpu":
        from benchmarks.gpu_bench import run
    elif args.bench == "train":
        from benchmarks.train_bench import run
    elif args.bench == "plan":
        from benchmarks.plan_bench import run
    elif args.bench == "cost":
        from benchmarks.cost_bench import run
    elif args.bench == "step":
        from benchmarks.step_bench import run
    elif args.bench == "cluster":
        from benchmarks.cluster_bench import run
    elif args.bench == "morph":
        from benchmarks.morph_bench import run
    else:
        raise AssertionError(args.bench)
    try:
        result = run(args)
    except ValueError as exc:  # a setting this machine or these flags cannot run: said, as a usage error
        print(f"netoptim bench {args.bench}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    if plot:
        from benchmarks.plot import plot_result

        print(f"netoptim bench {args.bench}: comparison drawn in {plot_result(args.bench, result, plot)}", file=sys.stderr)
    return 0
