"""``netoptim plan``: calibrate on this machine, then rank pipeline / data-parallel configurations."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path

from netoptim.plan_cluster_cli import add_cluster_plan_flags, cluster_requested, run_cluster_plan
from netoptim.plan_cost_cli import add_cost_flags, cost_mode, run_calibrate, run_catalog

log = logging.getLogger(__name__)


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The GPT whose configurations are planned (the model of ``examples/train_gpt_pipeline.py``)."""
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


@contextlib.contextmanager
def local_node() -> Iterator[tuple[str, int]]:
    """A fresh ``netoptim node`` on loopback for the calibration (its address and process id); stopped afterwards."""
    from launch.processes import NodeProcess

    with tempfile.TemporaryDirectory(prefix="netoptim-plan-") as workdir, NodeProcess(workdir, log_level="WARNING") as node:
        assert node.process is not None
        yield node.address, node.process.pid


def validate_model_flags(args: argparse.Namespace) -> None:
    for flag in ("n_layer", "n_embd", "n_head", "block_size", "workers", "nodes", "global_batch", "max_microbatches"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.n_embd % args.n_head:
        raise SystemExit(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    if args.cores < 0:
        raise SystemExit(f"--cores must be >= 0 (0: this machine's), got {args.cores}")
    if getattr(args, "memory_limit", 0) < 0:
        raise SystemExit(f"--memory-limit must be >= 0 bytes (0: no limit), got {args.memory_limit}")


def calibration_for(args: argparse.Namespace):  # -> PlanCalibration
    """Measure (or load) what :func:`~planning.planner.plan` needs for every candidate."""
    from gpu_worker.models import GPTConfig
    from gpu_worker.pipeline.calibration import calibrate_gpt
    from gpu_worker.recipes.train_gpt_pipeline import decay_groups
    from planning.planner import PlanCalibration, candidates

    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head)
    path = Path(args.calibration) if getattr(args, "calibration", "") else None
    if path is not None and path.exists():
        try:
            calibration = PlanCalibration.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"{path} is not a calibration netoptim plan wrote ({exc}); delete it to measure again") from None
        if calibration.model != dataclasses.asdict(config):
            raise SystemExit(
                f"{path} was measured for the model {calibration.model}, not {dataclasses.asdict(config)}: give its flags, or another file to measure anew"
            )
        log.info("calibration read from %s", path)
        return calibration
    found = candidates(args.workers, args.global_batch, args.n_layer + 2, args.nodes, max_microbatches=args.max_microbatches)
    if not found:
        raise SystemExit(f"no configuration of {args.workers} workers and {args.nodes} nodes divides a global batch of {args.global_batch}")
    micro_sizes = sorted({args.global_batch // (c.replicas * c.microbatches) for c in found})
    replicas = sorted({c.replicas for c in found})
    calibration = calibrate_gpt(
        config, seq_len=args.block_size, micro_sizes=micro_sizes, replicas=replicas, start_node=local_node, param_groups=decay_groups, cores=args.cores or None,
        progress=lambda what: log.info("calibrating: %s", what),
    )  # fmt: skip
    log.info("calibrating: the runtime's own overhead (two short pipeline runs)")
    measure_runtime_overhead(calibration, args)
    if path is not None:
        path.write_text(json.dumps(calibration.to_json()))
    return calibration


def measure_runtime_overhead(calibration, args: argparse.Namespace) -> None:
    """Two short runs through the real runtime fit the simulator's free parameters, in place:

    - a tiny GPT (almost no compute) on 2 stages with 4 micro-batches: the runtime's fixed cost per
      forward or backward action (p2p messages, Python);
    - the real model on 2 stages (1 where the batch or model allows no more), 2 micro-batches, GPipe:
      how much slower the calibrated compute runs inside a job, a scale on the calibrated update
      cost, and the rest of a step."""
    import torch

    from gpu_worker.models import GPT, GPTConfig
    from gpu_worker.pipeline import calibrate, pipeline_blocks
    from planning.planner import Candidate, fit_action_overhead, fit_compute_scale, predict

    tiny = {"n_layer": 2, "n_embd": 16, "n_head": 2, "block_size": 16}
    torch.manual_seed(0)
    tiny_costs = calibrate(pipeline_blocks(GPT(GPTConfig(**tiny))), torch.randint(0, 256, (1, tiny["block_size"])))
    tiny_candidate = Candidate(2, 1, 4, "gpipe", 1)
    tiny_pipeline_s, _, _ = _calibration_run(tiny_candidate, [2], global_batch=4, model=tiny)
    calibration.compute_scale = 1.0
    calibration.action_overhead_s = fit_action_overhead(calibration, tiny_costs, tiny_candidate, [2], tiny_pipeline_s)

    stages = 2 if args.workers >= 2 and args.global_batch % 2 == 0 else 1
    candidate = Candidate(stages, 1, 2 if args.global_batch % 2 == 0 else 1, "gpipe", 1)
    prediction = predict(calibration, candidate, args.global_batch)
    model = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "block_size": args.block_size}
    pipeline_s, optimizer_s, rest_s = _calibration_run(candidate, prediction.cuts, global_batch=args.global_batch, model=model)
    micro = args.global_batch // candidate.microbatches
    calibration.compute_scale = fit_compute_scale(calibration, calibration.block_costs[micro], candidate, prediction.cuts, pipeline_s)
    calibration.optimizer_scale = optimizer_s / prediction.optimizer_s if prediction.optimizer_s > 0 else 1.0
    calibration.step_overhead_s = max(0.0, rest_s)
    calibration.calibration_run = (candidate.stages, candidate.replicas, candidate.microbatches, candidate.schedule)
    log.info(
        "runtime: %.2f ms per action; in %s compute x%.2f of the blocks alone, update x%.2f of the node calibration, %.1f ms per step besides",
        calibration.action_overhead_s * 1e3, candidate.label(), calibration.compute_scale, calibration.optimizer_scale, rest_s * 1e3,
    )  # fmt: skip


def _calibration_run(candidate, cuts: list[int], *, global_batch: int, model: dict[str, int], steps: int = 10, warmup: int = 5) -> tuple[float, float, float]:
    """Run ``candidate`` for real; per step the slowest rank's pipeline, update and other time,
    medians over the timed steps."""
    import statistics

    from launch.processes import run_pipeline_job

    c = candidate
    reports = run_pipeline_job(c.stages, c.replicas, c.microbatches, c.schedule, cuts, global_batch=global_batch, model=model, steps=warmup + steps)
    timed = range(warmup, warmup + steps)
    slowest = {key: [max(r[key][i] for r in reports) for i in timed] for key in ("step_s", "pipeline_s", "optimizer_s")}
    rest = [step - pipe - opt for step, pipe, opt in zip(slowest["step_s"], slowest["pipeline_s"], slowest["optimizer_s"], strict=True)]
    return statistics.median(slowest["pipeline_s"]), statistics.median(slowest["optimizer_s"]), statistics.median(rest)


def run_plan(args: argparse.Namespace) -> int:
    validate_model_flags(args)  # before the imports: a bad flag answers at once
    if cluster_requested(args):
        return run_cluster_plan(args)
    mode = cost_mode(args)
    if mode == "calibrate":
        return run_calibrate(args)
    if mode == "catalog":
        return run_catalog(args)
    from planning.planner import plan

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
