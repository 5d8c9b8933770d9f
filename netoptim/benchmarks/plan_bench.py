"""``netoptim bench plan``: the planner's predicted step time against the measured one.

Calibrates as ``netoptim plan`` does, then launches a spread of the ranked configurations for real
(``P x D`` rank processes of ``netoptim.recipes.train_gpt_pipeline`` and fresh optimizer nodes),
each with the cut points the planner chose, and compares the median measured step time with the
prediction, and the measured bubble with the simulated and the schedule's theoretical one.
``ratio`` is the median of predicted over measured step time (1.0 is a perfect planner).
"""

from __future__ import annotations

import argparse
import statistics

from tqdm import tqdm

from netoptim.cli.plan import validate_model_flags
from netoptim.cli.plan_calibration import calibration_for
from netoptim.launch.processes import run_pipeline_job
from netoptim.planning.planner import Prediction, plan


def measure(args: argparse.Namespace, prediction: Prediction) -> dict:
    """Run the configuration for ``args.steps`` steps after ``args.warmup``: the median step time (of
    the slowest rank each step) and the median bubble over ranks and steps."""
    c = prediction.candidate
    model = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "block_size": args.block_size}
    reports = run_pipeline_job(
        c.stages, c.replicas, c.microbatches, c.schedule, prediction.cuts, global_batch=args.global_batch, model=model,
        steps=args.warmup + args.steps, nodes_per_stage=c.nodes_per_stage, timeout_s=args.timeout_s,
    )  # fmt: skip
    timed = range(args.warmup, args.warmup + args.steps)
    return {
        "step_s": statistics.median(max(r["step_s"][i] for r in reports) for i in timed),
        "bubble_fraction": statistics.median(1 - r["compute_s"][i] / r["pipeline_s"][i] for r in reports for i in timed),
    }


def pick(predictions: list[Prediction], count: int, exclude: tuple) -> list[Prediction]:
    """``count`` runnable configurations spread over the ranking, the best first; not the one the
    calibration ran (its figures were fitted on it)."""
    runnable = [
        p
        for p in predictions
        if not p.candidate.layerwise and (p.candidate.stages, p.candidate.replicas, p.candidate.microbatches, p.candidate.schedule) != exclude
    ]
    if len(runnable) <= count:
        return runnable
    return [runnable[round(i * (len(runnable) - 1) / (count - 1))] for i in range(count)] if count > 1 else runnable[:1]


def run(args: argparse.Namespace) -> dict:
    validate_model_flags(args)
    calibration = calibration_for(args)
    predictions = plan(calibration, args.workers, args.global_batch, args.nodes)
    rows = []
    for prediction in tqdm(pick(predictions, args.configs, tuple(calibration.calibration_run)), desc="measuring configurations"):
        measured = measure(args, prediction)
        error = (prediction.step_s - measured["step_s"]) / measured["step_s"]
        rows.append({
            "configuration": prediction.candidate.label(), "cuts": prediction.cuts,
            "predicted_step_s": round(prediction.step_s, 4), "measured_step_s": round(measured["step_s"], 4), "error": round(error, 3),
            "predicted_bubble": round(prediction.bubble_fraction, 3), "measured_bubble": round(measured["bubble_fraction"], 3),
            "theoretical_bubble": round(prediction.theoretical_bubble, 3),
        })  # fmt: skip
    errors = [abs(r["error"]) for r in rows]
    return {
        "benchmark": "plan",
        "ratio": statistics.median(r["predicted_step_s"] / r["measured_step_s"] for r in rows),
        "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors),
        "within_15_percent": sum(e <= 0.15 for e in errors),
        "configurations": rows,
        "model": {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "block_size": args.block_size},
        "workers": args.workers, "nodes": args.nodes, "global_batch": args.global_batch, "cores": calibration.cores,
    }  # fmt: skip
