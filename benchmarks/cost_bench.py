"""``netoptim bench cost``: the cost planner's step-time model against measured step times.

Measures a cost profile as ``netoptim plan --calibrate`` does (or reads ``--profile``), then runs a
spread of configurations of the model for real on this machine (``P x D`` rank processes of
``gpu_worker.recipes.train_gpt_pipeline`` and fresh optimizer nodes, every rank and node sharing
this machine's cores over loopback) and compares each median step time with what
:func:`~planning.cost_model.estimate_step` predicts for this machine
(:func:`~planning.cost_model.local_hardware`): the model the cost planner prices a catalog's
machines with. ``ratio`` is the median of predicted over measured step time (1.0: a perfect model);
``within_15_percent`` counts the configurations predicted within 15%.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from tqdm import tqdm

from benchmarks.plan_bench import measure
from netoptim.plan_cli import validate_model_flags
from netoptim.plan_cost_cli import load_profile, run_calibrate
from planning.cost_model import CostProfile, StepEstimate, estimate_step, local_hardware
from planning.planner import Candidate, Prediction, candidates


def configurations(profile: CostProfile, args: argparse.Namespace) -> list[Candidate]:
    """Every full-model configuration of ``args.workers`` ranks and ``args.nodes`` nodes whose
    micro-batch the profile measured, but the calibration's own run (its figures were fitted on it)."""
    cal = profile.pipeline
    num_blocks = len(next(iter(cal.block_costs.values())))
    fitted = tuple(cal.calibration_run)
    found = []
    for c in candidates(args.workers, args.global_batch, num_blocks, args.nodes, max_microbatches=args.max_microbatches):
        if c.layerwise or (c.stages, c.replicas, c.microbatches, c.schedule) == fitted:
            continue
        if args.global_batch // (c.replicas * c.microbatches) in cal.block_costs:
            found.append(c)
    return found


def spread(found: list[Candidate], count: int) -> list[Candidate]:
    if len(found) <= count:
        return found
    return [found[round(i * (len(found) - 1) / (count - 1))] for i in range(count)] if count > 1 else found[:1]


def run(args: argparse.Namespace) -> dict:
    validate_model_flags(args)
    if args.profile:
        profile = load_profile(args.profile)
    else:
        with tempfile.TemporaryDirectory(prefix="netoptim-cost-") as workdir:
            args.calibrate = str(Path(workdir) / "profile.json")
            run_calibrate(args, announce=False)
            profile = load_profile(args.calibrate)
    hardware = local_hardware(profile)
    rows = []
    for candidate in tqdm(spread(configurations(profile, args), args.configs), desc="measuring configurations"):
        estimate: StepEstimate = estimate_step(profile, candidate, args.global_batch, hardware)
        prediction = Prediction(candidate, estimate.step_s, estimate.pipeline_s, estimate.update_s, estimate.bubble_fraction, 0.0, estimate.cuts, 0)
        measured = measure(args, prediction)
        error = (estimate.step_s - measured["step_s"]) / measured["step_s"]
        rows.append({
            "configuration": candidate.label(), "cuts": estimate.cuts, "predicted_step_s": round(estimate.step_s, 4),
            "predicted_pipeline_s": round(estimate.pipeline_s, 4), "predicted_update_s": round(estimate.update_s, 4),
            "measured_step_s": round(measured["step_s"], 4), "error": round(error, 3),
        })  # fmt: skip
    if not rows:
        raise SystemExit("no configuration to measure: give more --workers or a larger --global-batch")
    errors = [abs(r["error"]) for r in rows]
    return {
        "benchmark": "cost",
        "ratio": round(statistics.median(r["predicted_step_s"] / r["measured_step_s"] for r in rows), 3),
        "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors),
        "within_15_percent": sum(e <= 0.15 for e in errors),
        "configurations": rows,
        "model": {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "block_size": args.block_size},
        "workers": args.workers, "nodes": args.nodes, "global_batch": args.global_batch, "cores": profile.pipeline.cores,
    }  # fmt: skip
