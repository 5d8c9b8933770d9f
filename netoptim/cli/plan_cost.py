"""``netoptim plan --calibrate FILE`` (write a cost profile) and ``netoptim plan --catalog FILE
--profile FILE --deadline H | --budget X`` (choose machines from a catalog by price)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
from pathlib import Path

from netoptim.cli.arg_types import positive_int

log = logging.getLogger(__name__)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text} must be a positive number")
    return value


def _non_negative_float(text: str) -> float:
    value = 0.0 if text.strip() in ("0", "0.0") else _positive_float(text)
    return value


def add_cost_flags(plan: argparse.ArgumentParser) -> None:
    """The cost planner's flags on ``netoptim plan``."""
    cost = plan.add_argument_group(
        "cost planner",
        "--calibrate FILE measures a cost profile of the model (the flags above) and writes it; --catalog FILE --profile FILE with "
        "--deadline or --budget then chooses machine types and counts for workers and nodes, P x D and micro-batches (docs/planning.md)",
    )
    cost.add_argument(
        "--calibrate", default="", metavar="FILE", help="measure the model, a node's update and the runtime here, write the profile to FILE, exit"
    )
    cost.add_argument("--catalog", default="", metavar="FILE", help="TOML catalog of machine types with prices (examples/machines.toml)")
    cost.add_argument("--profile", default="", metavar="FILE", help="with --catalog: the profile --calibrate wrote")
    cost.add_argument(
        "--deadline", type=_positive_float, default=None, metavar="HOURS", help="with --catalog: finish within this many hours, at the lowest cost"
    )
    cost.add_argument("--budget", type=_positive_float, default=None, metavar="AMOUNT", help="with --catalog: spend at most this much, finish soonest")
    cost.add_argument("--steps", type=positive_int, default=None, help="with --catalog: optimizer steps to train for (required there)")
    cost.add_argument(
        "--max-machines", type=positive_int, default=16, help="with --catalog: the most machines per role, tried in powers of two (default: %(default)s)"
    )
    cost.add_argument(
        "--replacement-s",
        type=_non_negative_float,
        default=300.0,
        help="with --catalog: seconds until a preempted spot machine is replaced (default: %(default)s)",
    )
    cost.add_argument(
        "--checkpoint-interval-s",
        type=_positive_float,
        default=1800.0,
        help="with --catalog: seconds between node checkpoints, for spot nodes (default: %(default)s)",
    )
    cost.add_argument(
        "--morph-pause-steps",
        type=_non_negative_float,
        default=2.0,
        help="with --catalog: steps a worker's departure costs the job (netoptim bench morph measures it; default: %(default)s)",
    )
    cost.add_argument("--spot-nodes", action="store_true", help="with --catalog: also put optimizer nodes on spot machines (they resume from checkpoints)")


def cost_mode(args: argparse.Namespace) -> str:
    """``calibrate``, ``catalog`` or ``""`` (the pipeline planner), after checking the flags go together."""
    if args.calibrate and args.catalog:
        raise SystemExit("give --calibrate FILE (measure a profile) or --catalog FILE (plan from one), not both")
    catalog_only = [flag for flag in ("profile", "deadline", "budget", "steps") if getattr(args, flag) not in ("", None)]
    if args.catalog:
        if not args.profile:
            raise SystemExit("--catalog needs --profile FILE: measure one first with netoptim plan --calibrate FILE (docs/planning.md)")
        if (args.deadline is None) == (args.budget is None):
            raise SystemExit("--catalog needs exactly one of --deadline HOURS and --budget AMOUNT")
        if args.steps is None:
            raise SystemExit("--catalog needs --steps: the optimizer steps to train for")
        return "catalog"
    if catalog_only:
        raise SystemExit(f"--{catalog_only[0]} goes with --catalog FILE")
    return "calibrate" if args.calibrate else ""


def run_calibrate(args: argparse.Namespace, *, announce: bool = True) -> int:
    """Measure the cost profile of the model and write it to ``args.calibrate`` (and say so on
    stdout unless ``announce`` is false: a benchmark's stdout is its JSON)."""
    from netoptim.cli.plan_calibration import calibration_for
    from netoptim.planning.cost_model import CostProfile, estimate_step, local_hardware
    from netoptim.planning.planner import Candidate, predict
    from optimizer_node.update.profile import update_pass_seconds_per_param

    if args.workers < 2:
        raise SystemExit("--calibrate measures updates with 1 and 2 workers: give --workers 2 or more")
    path = Path(args.calibrate)
    if not path.parent.is_dir():
        raise SystemExit(f"cannot write the profile to {path}: {path.parent} is not a directory")
    args.calibration = ""
    calibration = calibration_for(args)
    log.info("calibrating: the node's update pass at 1 and 2 gradient terms and threads")
    update_pass = {terms: update_pass_seconds_per_param(terms, 1) for terms in (1, 2)}
    two_threads = update_pass_seconds_per_param(2, 2)
    efficiency = max(0.0, min(1.0, update_pass[2] / two_threads - 1.0))
    profile = CostProfile(pipeline=calibration, update_pass_s=update_pass, thread_efficiency=efficiency, device=_device())
    # the update inside the calibration's real run, over what the cost model gives for it
    stages, replicas, microbatches, schedule = calibration.calibration_run
    if stages:
        candidate = Candidate(stages, replicas, microbatches, schedule, 1)
        unscaled = predict(_with(calibration, optimizer_scale=1.0), candidate, args.global_batch)
        measured_update_s = calibration.optimizer_scale * unscaled.optimizer_s
        modeled = estimate_step(profile, candidate, args.global_batch, local_hardware(profile))
        if modeled.update_s > 0:  # the CPU parts of the update scale with it (the loopback link's share is small)
            profile.shared_update_scale = measured_update_s / modeled.update_s
    path.write_text(json.dumps(profile.to_json()))
    (print if announce else log.info)(
        f"profile written to {path}: update pass {update_pass[1] * 1e9:.2f} / {update_pass[2] * 1e9:.2f} ns per parameter with 1 / 2 workers, "
        f"a second thread adds {efficiency:.0%}, shared-host update x{profile.shared_update_scale:.2f}"
    )
    return 0


def _with(calibration, **changes):  # -> PlanCalibration
    import dataclasses

    return dataclasses.replace(calibration, **changes)


def _device() -> str:
    return f"one CPU core of a {os.cpu_count()}-core {platform.machine()} machine"


def load_profile(path: str):  # -> CostProfile
    from netoptim.planning.cost_model import CostProfile, ProfileError

    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise SystemExit(f"cannot read the profile {path}: {exc.strerror or exc}; write one with netoptim plan --calibrate {path}") from None
    except ValueError as exc:
        raise SystemExit(f"{path} is not JSON ({exc}); write a profile with netoptim plan --calibrate {path}") from None
    try:
        return CostProfile.from_json(raw)
    except ProfileError as exc:
        raise SystemExit(f"{path}: {exc}") from None


def run_catalog(args: argparse.Namespace) -> int:
    """Price every configuration on the catalog's machines and print the best."""
    from netoptim.planning.catalog import CatalogError, load_catalog
    from netoptim.planning.cost_search import Job, plan_cost, why

    try:
        catalog = load_catalog(args.catalog)
    except CatalogError as exc:
        raise SystemExit(str(exc)) from None
    profile = load_profile(args.profile)
    if profile.pipeline.model and profile.pipeline.model.get("n_layer") not in (None, args.n_layer):
        log.info("planning the model the profile measured: %s", profile.pipeline.model)
    worker_efficiency = node_efficiency = 1.0
    if args.cluster_calibration:
        from netoptim.cluster.prediction import CalibrationError, efficiencies_from_reports

        try:
            measured = efficiencies_from_reports(p for p in args.cluster_calibration.split(",") if p)
        except CalibrationError as exc:
            raise SystemExit(str(exc)) from None
        found = [measured.get(f"netoptim/{side}-link") for side in ("worker", "node")]
        known = [value for value in found if value is not None]
        if not known:
            raise SystemExit(f"{args.cluster_calibration}: no netoptim run in these reports")
        worker_efficiency, node_efficiency = (value if value is not None else sum(known) / len(known) for value in found)
        log.info("netoptim link efficiency: %.2f where a worker's link bounds, %.2f where a node's", worker_efficiency, node_efficiency)
    job = Job(
        worker_link_efficiency=worker_efficiency,
        node_link_efficiency=node_efficiency,
        steps=args.steps, global_batch=args.global_batch, deadline_h=args.deadline, budget=args.budget, max_machines=args.max_machines,
        max_microbatches=args.max_microbatches, replacement_s=args.replacement_s, morph_pause_steps=args.morph_pause_steps,
        checkpoint_interval_s=args.checkpoint_interval_s, spot_nodes=args.spot_nodes,
    )  # fmt: skip
    log.info("cost planner: %s", job)
    ranked, priced = plan_cost(profile, catalog, job)
    if not priced:
        raise SystemExit("no configuration fits the catalog's machines (GPU or node memory): add larger machines or raise --max-machines")
    if not ranked:
        best = min(priced, key=lambda o: o.hours) if args.deadline is not None else min(priced, key=lambda o: o.cost)
        limit = f"the deadline of {args.deadline:g} h" if args.deadline is not None else f"the budget of {args.budget:g} {catalog.currency}"
        raise SystemExit(f"no configuration meets {limit}: the closest is {best.label()}, {best.hours:.3g} h for {best.cost:.4g} {catalog.currency}")
    shown = ranked[: args.top]
    if args.json:
        print(
            json.dumps(
                {"note": catalog.note, "currency": catalog.currency, "why": why(ranked, priced, job, catalog.currency), "options": [_row(o) for o in shown]},
                indent=2,
            )
        )
        return 0
    if catalog.note:
        print(f"catalog: {catalog.note}")
    print(f"{'#':>2}  {'workers':<22} {'nodes':<18} {'P':>2} {'D':>3} {'M':>3} {'schedule':<11} {'step s':>8} {'hours':>8} {'cost':>10}  spot loss")
    for index, option in enumerate(shown, 1):
        c = option.estimate.candidate
        print(
            f"{index:>2}  {option.workers.label():<22} {option.nodes.label():<18} {c.stages:>2} {c.replicas:>3} {c.microbatches:>3} {c.schedule:<11} "
            f"{option.estimate.step_s:>8.4f} {option.hours:>8.3g} {option.cost:>10.4g}  {option.lost_fraction:.1%}"
        )
    print(f"\nwhy #1 ({catalog.currency}):")
    for line in why(ranked, priced, job, catalog.currency):
        print(f"  - {line}")
    return 0


def _row(option) -> dict:
    c, e = option.estimate.candidate, option.estimate
    return {
        "workers": {"machine": option.workers.machine.name, "count": option.workers.count, "spot": option.workers.spot},
        "nodes": {"machine": option.nodes.machine.name, "count": option.nodes.count, "spot": option.nodes.spot},
        "stages": c.stages, "replicas": c.replicas, "microbatches": c.microbatches, "schedule": c.schedule, "nodes_per_stage": c.nodes_per_stage,
        "predicted_step_s": e.step_s, "pipeline_s": e.pipeline_s, "update_s": e.update_s, "hours": option.hours, "ideal_hours": option.ideal_h,
        "cost": option.cost, "preemption_loss": option.lost_fraction, "worker_memory_bytes": e.worker_memory_bytes,
        "node_memory_bytes": e.node_memory_bytes, "bottleneck": option.bottleneck(),
    }  # fmt: skip
