"""``netoptim bench plan``: the planner's predicted step time against the measured one.

Calibrates as ``netoptim plan`` does, then launches a spread of the ranked configurations for real
(``P x D`` rank processes of ``gpu_worker.recipes.train_gpt_pipeline`` and fresh optimizer nodes),
each with the cut points the planner chose, and compares the median measured step time with the
prediction, and the measured bubble with the simulated and the schedule's theoretical one.
``ratio`` is the median of predicted over measured step time (1.0 is a perfect planner).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from tqdm import tqdm

from gpu_worker.pipeline.planner import Prediction, plan
from netoptim.launcher import NodeProcess, run_workers
from netoptim.plan_cli import calibration_for, validate_model_flags


def measure(args: argparse.Namespace, prediction: Prediction) -> dict:
    """Run the configuration for ``args.steps`` steps; the median step time after ``args.warmup``."""
    c = prediction.candidate
    with tempfile.TemporaryDirectory(prefix="netoptim-plan-bench-") as workdir:
        nodes = [NodeProcess(workdir, name=f"node{i}", log_level="WARNING") for i in range(c.stages * c.nodes_per_stage)]
        try:
            for node in nodes:
                node.start()
            script = [
                "--nodes", ",".join(n.address for n in nodes), "--stages", str(c.stages), "--microbatches", str(c.microbatches),
                "--schedule", c.schedule, "--cuts", ",".join(map(str, prediction.cuts)), "--steps", str(args.warmup + args.steps),
                "--global-batch", str(args.global_batch), "--block-size", str(args.block_size), "--n-layer", str(args.n_layer),
                "--n-embd", str(args.n_embd), "--n-head", str(args.n_head), "--report", str(Path(workdir) / "report"), "--quiet",
            ]  # fmt: skip
            status = run_workers(script, c.stages * c.replicas, module="gpu_worker.recipes.train_gpt_pipeline", timeout_s=args.timeout_s, quiet=True)
            if status != 0:
                raise RuntimeError(f"{c.label()}: the ranks failed with status {status}")
            reports = [json.loads(p.read_text()) for p in sorted((Path(workdir) / "report").glob("rank*.json"))]
        finally:
            for node in nodes:
                node.stop()
    steps = [max(r["step_s"][i] for r in reports) for i in range(args.warmup, args.warmup + args.steps)]
    bubbles = [1 - r["compute_s"][i] / r["pipeline_s"][i] for r in reports for i in range(args.warmup, args.warmup + args.steps)]
    return {
        "step_s": statistics.median(steps),
        "bubble_fraction": statistics.median(bubbles),
        "optimizer_s": statistics.median(r["optimizer_s"][-1] for r in reports),
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
