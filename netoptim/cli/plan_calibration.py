"""What ``netoptim plan`` measures on this machine: the pipeline planner's calibration (blocks, link,
a node's update through real local nodes, two short real pipeline runs), read from or written to a
file (shared by ``netoptim plan``, ``--calibrate`` and the plan and cost benchmarks)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


@contextlib.contextmanager
def local_node() -> Iterator[tuple[str, int]]:
    """A fresh ``netoptim node`` on loopback for the calibration (its address and process id); stopped afterwards."""
    from netoptim.launch.processes import NodeProcess

    with tempfile.TemporaryDirectory(prefix="netoptim-plan-") as workdir, NodeProcess(workdir, log_level="WARNING") as node:
        assert node.process is not None
        yield node.address, node.process.pid


def calibration_for(args: argparse.Namespace):  # -> PlanCalibration
    """Measure (or load) what :func:`~netoptim.planning.planner.plan` needs for every candidate."""
    from gpu_worker.models import GPTConfig
    from netoptim.planning.gpt_calibration import calibrate_gpt
    from netoptim.planning.planner import PlanCalibration, candidates
    from netoptim.recipes.train_gpt_pipeline import decay_groups

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
    from netoptim.planning.planner import Candidate, fit_action_overhead, fit_compute_scale, predict

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

    from netoptim.launch.processes import run_pipeline_job

    c = candidate
    reports = run_pipeline_job(c.stages, c.replicas, c.microbatches, c.schedule, cuts, global_batch=global_batch, model=model, steps=warmup + steps)
    timed = range(warmup, warmup + steps)
    slowest = {key: [max(r[key][i] for r in reports) for i in timed] for key in ("step_s", "pipeline_s", "optimizer_s")}
    rest = [step - pipe - opt for step, pipe, opt in zip(slowest["step_s"], slowest["pipeline_s"], slowest["optimizer_s"], strict=True)]
    return statistics.median(slowest["pipeline_s"]), statistics.median(slowest["optimizer_s"]), statistics.median(rest)
