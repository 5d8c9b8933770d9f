"""``netoptim plan``: calibrate on this machine, then rank pipeline / data-parallel configurations."""

from __future__ import annotations

import argparse
import json
import logging

from netoptim.cli.plan_calibration import calibration_for
from netoptim.cli.plan_cluster import add_cluster_plan_flags, cluster_requested, run_cluster_plan
from netoptim.cli.plan_cost import add_cost_flags, cost_mode, run_calibrate, run_catalog

log = logging.getLogger(__name__)


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The GPT whose configurations are planned (the model of ``examples/train_gpt_pipeline.py``), or a
    Hugging Face config that sets its shape (``--hf-config``)."""
    parser.add_argument(
        "--hf-config",
        default=None,
        metavar="PATH",
        help="a Hugging Face model directory or its config.json: plan for its depth, width and attention heads (in place of "
        "--n-layer, --n-embd and --n-head; the calibration times GPT blocks of that shape for its decoder layers)",
    )
    parser.add_argument("--n-layer", type=int, default=8, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--n-embd", type=int, default=256, help="model width (default: %(default)s)")
    parser.add_argument("--n-head", type=int, default=4, help="attention heads (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="worker ranks to plan for, P x D (default: %(default)s)")
    parser.add_argument("--nodes", type=int, default=2, help="optimizer nodes available; each pipeline position gets nodes // P (default: %(default)s)")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step over all replicas (default: %(default)s)")
    parser.add_argument("--max-microbatches", type=int, default=8, help="largest number of micro-batches per replica tried (default: %(default)s)")
    parser.add_argument(
        "--cores", type=float, default=0, help="cores the ranks and nodes share (default: this machine's; on one GPU per rank give the rank count or more)"
    )


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser(
        "plan",
        help="rank pipeline x data-parallel configurations by simulated step time, from a short calibration",
        description=(
            "Measures the model's blocks (forward and backward at each micro-batch size), the loopback link and an optimizer "
            "node's update on this machine (local nodes are started for it), then simulates the step time of every configuration "
            "(stages P, replicas D, micro-batches M, schedule, nodes per stage, layer-wise or not) and prints them fastest first "
            "with the memory each rank needs."
        ),
    )
    add_model_flags(plan)
    plan.add_argument("--memory-limit", type=int, default=0, help="drop configurations needing more bytes than this on any rank (default: no limit)")
    plan.add_argument("--calibration", default="", help="JSON file: read the calibration from it if it exists, else measure and write it there")
    plan.add_argument("--top", type=int, default=10, help="configurations printed (default: %(default)s)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_cost_flags(plan)
    add_cluster_plan_flags(plan)


def validate_model_flags(args: argparse.Namespace) -> None:
    if getattr(args, "hf_config", None):
        from netoptim.planning.hf_config import HFConfigError, gpt_proxy_shape

        try:
            args.n_layer, args.n_embd, args.n_head = gpt_proxy_shape(args.hf_config)
        except HFConfigError as exc:
            raise SystemExit(str(exc)) from None
        log.info("planning for %s: %d layers, width %d, %d heads", args.hf_config, args.n_layer, args.n_embd, args.n_head)
    for flag in ("n_layer", "n_embd", "n_head", "block_size", "workers", "nodes", "global_batch", "max_microbatches"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.n_embd % args.n_head:
        raise SystemExit(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    if args.cores < 0:
        raise SystemExit(f"--cores must be >= 0 (0: this machine's), got {args.cores}")
    if getattr(args, "memory_limit", 0) < 0:
        raise SystemExit(f"--memory-limit must be >= 0 bytes (0: no limit), got {args.memory_limit}")


def run_plan(args: argparse.Namespace) -> int:
    validate_model_flags(args)  # before the imports: a bad flag answers at once
    if cluster_requested(args):
        return run_cluster_plan(args)
    mode = cost_mode(args)
    if mode == "calibrate":
        return run_calibrate(args)
    if mode == "catalog":
        return run_catalog(args)
    from netoptim.planning.planner import plan

    calibration = calibration_for(args)
    predictions = plan(calibration, args.workers, args.global_batch, args.nodes, memory_limit=args.memory_limit or None)
    if not predictions:
        raise SystemExit("no configuration fits: raise --memory-limit, or plan with more workers or nodes")
    shown = predictions[: args.top]
    if args.json:
        print(json.dumps([_as_row(p) for p in shown], indent=2))
        return 0
    print(f"{'configuration':<58} {'step s':>8} {'samples/s':>10} {'bubble':>7} {'memory/rank':>12}  cuts")
    for p in shown:
        print(
            f"{p.candidate.label():<58} {p.step_s:>8.3f} {p.samples_per_s:>10.1f} {p.bubble_fraction:>7.2f} {p.peak_memory_bytes / 2**20:>9.1f} MiB  {p.cuts}"
        )
    return 0


def _as_row(prediction) -> dict:
    c = prediction.candidate
    return {
        "stages": c.stages, "replicas": c.replicas, "microbatches": c.microbatches, "schedule": c.schedule,
        "nodes_per_stage": c.nodes_per_stage, "layerwise": c.layerwise, "predicted_step_s": prediction.step_s,
        "pipeline_s": prediction.pipeline_s, "optimizer_s": prediction.optimizer_s, "bubble_fraction": prediction.bubble_fraction,
        "theoretical_bubble": prediction.theoretical_bubble, "peak_memory_bytes": prediction.peak_memory_bytes, "cuts": prediction.cuts,
    }  # fmt: skip
