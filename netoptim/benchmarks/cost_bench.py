"""``netoptim bench cost``: the cost planner's step-time model against measured step times.

Measures a cost profile as ``netoptim plan --calibrate`` does (or reads ``--profile``), then runs a
spread of configurations of the model for real on this machine (``P x D`` rank processes of
``netoptim.recipes.train_gpt_pipeline`` and fresh optimizer nodes, every rank and node sharing
this machine's cores over loopback) and compares each median step time with what
:func:`~netoptim.planning.cost_model.estimate_step` predicts for this machine
(:func:`~netoptim.planning.cost_model.local_hardware`): the model the cost planner prices a catalog's
machines with. ``ratio`` is the median of predicted over measured step time (1.0: a perfect model);
``within_15_percent`` counts the configurations predicted within 15%.

``--cluster-reports`` adds netoptim's steps measured on the emulated cluster (``netoptim cluster
--json`` reports, one worker per host, the same model): the model predicts them with this profile and
the links at the efficiencies of the ``--cluster-calibration`` reports (runs used for that are
marked and left out of the error figures).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from tqdm import tqdm

from netoptim.benchmarks.plan_bench import measure
from netoptim.cli.plan import validate_model_flags
from netoptim.cli.plan_cost import load_profile, run_calibrate
from netoptim.planning.cost_model import CostProfile, Hardware, StepEstimate, estimate_step, local_hardware
from netoptim.planning.planner import Candidate, Prediction, candidates


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


def cluster_rows(profile: CostProfile, reports: list[str], calibration: list[str]) -> list[dict]:
    """The step model against netoptim's measured steps in emulated-cluster reports (``netoptim
    cluster --json``; one worker per host, the model the profile measured), its links at the
    efficiencies of the ``calibration`` reports."""
    import json

    from netoptim.cluster.prediction import efficiencies_from_reports
    from netoptim.planning.cluster_model import TCP_PAYLOAD_SHARE

    measured = efficiencies_from_reports(calibration) if calibration else {}
    rows = []
    for path in reports:
        raw = json.loads(Path(path).read_text())
        shape, model = raw["cluster"], raw["model"]
        if shape["workers_per_host"] != 1 or "netoptim" not in raw["results"]:
            raise SystemExit(f"{path}: the step model covers netoptim runs with one worker per host")
        if {k: model[k] for k in ("n_layer", "n_embd", "n_head", "block_size")} != {
            k: profile.pipeline.model.get(k) for k in ("n_layer", "n_embd", "n_head", "block_size")
        }:
            raise SystemExit(f"{path}: a run of the model {model}, the profile measured {profile.pipeline.model}")
        rate = raw["links"]["emulated_bit_s"] / 8 * TCP_PAYLOAD_SHARE
        hardware = Hardware(
            worker_link_bytes_per_s=rate, node_link_bytes_per_s=rate, link_latency_s=1e-4, shared_cores=float(raw.get("cores") or profile.pipeline.cores),
            worker_link_efficiency=measured.get("netoptim/worker-link", 1.0), node_link_efficiency=measured.get("netoptim/node-link", 1.0),
        )  # fmt: skip
        workers, nodes = shape["worker_hosts"], shape["node_hosts"]
        global_batch = raw["batch"]["global_batch"]
        bucket_bytes = 4 * int(raw["netoptim_bucket_numel"])
        estimate = estimate_step(profile, Candidate(1, workers, 1, "gpipe", nodes), global_batch, hardware, bucket_bytes=bucket_bytes)
        step_s = raw["results"]["netoptim"]["step_s"]
        rows.append({
            "configuration": f"emulated cluster {workers}x1+{nodes}, {raw['links']['emulated_bit_s'] / 1e6:.3g} Mbit/s: P=1 D={workers}",
            "predicted_step_s": round(estimate.step_s, 4), "predicted_pipeline_s": round(estimate.pipeline_s, 4),
            "predicted_update_s": round(estimate.update_s, 4), "measured_step_s": round(step_s, 4), "error": round(estimate.step_s / step_s - 1, 3),
            "calibration_run": str(path) in calibration,
        })  # fmt: skip
    return rows


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
    for candidate in tqdm(spread(configurations(profile, args), args.configs) if args.configs else [], desc="measuring configurations"):
        estimate: StepEstimate = estimate_step(profile, candidate, args.global_batch, hardware)
        prediction = Prediction(candidate, estimate.step_s, estimate.pipeline_s, estimate.update_s, estimate.bubble_fraction, 0.0, estimate.cuts, 0)
        measured = measure(args, prediction)
        error = (estimate.step_s - measured["step_s"]) / measured["step_s"]
        rows.append({
            "configuration": candidate.label(), "cuts": estimate.cuts, "predicted_step_s": round(estimate.step_s, 4),
            "predicted_pipeline_s": round(estimate.pipeline_s, 4), "predicted_update_s": round(estimate.update_s, 4),
            "measured_step_s": round(measured["step_s"], 4), "error": round(error, 3),
        })  # fmt: skip
    rows += cluster_rows(profile, [p for p in args.cluster_reports.split(",") if p], [p for p in args.cluster_calibration.split(",") if p])
    if not rows:
        raise SystemExit("no configuration to measure: give more --workers or a larger --global-batch")
    errors = [abs(r["error"]) for r in rows if not r.get("calibration_run")]
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
