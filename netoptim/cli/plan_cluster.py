"""``netoptim plan --cluster HxG+N --link-mbit R``: the step time of netoptim, FSDP and DDP on hosts
joined by links of that rate, from a compute probe here and the link efficiencies of earlier runs."""

from __future__ import annotations

import argparse
import json
import logging
import re

log = logging.getLogger(__name__)

_SHAPE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*\+\s*(\d+)\s*$")


def cluster_shape(text: str) -> tuple[int, int, int]:
    """``HxG+N``: worker hosts, workers per host, node hosts."""
    match = _SHAPE.match(text)
    if not match or min(int(g) for g in match.groups()) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a cluster shape HxG+N with positive counts, like 4x2+2")
    hosts, per_host, nodes = (int(g) for g in match.groups())
    return hosts, per_host, nodes


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be positive")
    return value


def add_cluster_plan_flags(plan: argparse.ArgumentParser) -> None:
    group = plan.add_argument_group(
        "across hosts",
        "--cluster HxG+N --link-mbit R predicts each system's step on H worker hosts of G workers and N node hosts (docs/planning.md)",
    )
    group.add_argument("--cluster", type=cluster_shape, default=None, metavar="HxG+N", help="predict the step on this cluster shape, like 4x2+2")
    group.add_argument("--link-mbit", type=_rate, default=None, help="with --cluster: every worker host's link, Mbit/s each way")
    group.add_argument(
        "--node-link-mbit", type=_rate, default=None, help="with --cluster: every optimizer-node host's link, Mbit/s each way (default: --link-mbit)"
    )
    group.add_argument("--micro-batch", type=int, default=8, help="with --cluster: sequences per worker per step (default: %(default)s)")
    group.add_argument(
        "--cluster-calibration",
        default="",
        metavar="REPORTS",
        help="with --cluster: comma-separated JSON reports of netoptim cluster --json or bench cluster on the same links; "
        "their measured link efficiencies scale the ideal times (default: none, the links' ideal rate)",
    )
    group.add_argument(
        "--cluster-cores",
        type=float,
        default=0,
        help="with --cluster: cores all ranks share (default 0: a device per rank; give this machine's for an emulated cluster)",
    )


def cluster_requested(args: argparse.Namespace) -> bool:
    if args.cluster is None:
        if args.link_mbit is not None or args.node_link_mbit is not None or (args.cluster_calibration and not args.catalog):
            raise SystemExit("--link-mbit and --node-link-mbit go with --cluster HxG+N, --cluster-calibration with --cluster or --catalog")
        return False
    if args.link_mbit is None:
        raise SystemExit("--cluster needs --link-mbit: the links' rate, Mbit/s each way")
    if args.micro_batch < 1 or args.cluster_cores < 0:
        raise SystemExit("--micro-batch must be >= 1 and --cluster-cores >= 0")
    return True


def run_cluster_plan(args: argparse.Namespace) -> int:
    from gpu_worker.models import GPTConfig
    from netoptim.cluster.prediction import CalibrationError, efficiencies_from_reports, predict_cluster
    from netoptim.cluster.report import Shape
    from netoptim.cluster.scaling import measure_step_seconds, param_count
    from netoptim.cluster.session import auto_bucket_numel
    from netoptim.planning.cluster_model import ClusterTiming

    shape = Shape(*args.cluster)
    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head)
    efficiency: dict[str, float] = {}
    if args.cluster_calibration:
        try:
            efficiency = efficiencies_from_reports(p for p in args.cluster_calibration.split(",") if p)
        except CalibrationError as exc:
            raise SystemExit(str(exc)) from None
        log.info("link efficiencies from %s: %s", args.cluster_calibration, efficiency)
    compute_s = measure_step_seconds(config, args.micro_batch, args.block_size)
    params = param_count(config)
    buckets = -(-params // auto_bucket_numel(params))  # netoptim cluster's default
    timing = ClusterTiming(
        compute_s=compute_s,
        link_bit_s=args.link_mbit * 1e6,
        node_link_bit_s=(args.node_link_mbit or 0.0) * 1e6,
        ranks=shape.world_size,
        cores=args.cluster_cores or None,
        buckets=buckets,
        efficiency=efficiency,
    )
    predictions = predict_cluster(config, shape, timing)
    tokens = shape.world_size * args.micro_batch * args.block_size
    rows = {
        mode: {**p.to_dict(), "tokens_per_s": tokens / p.step_s, "efficiency": timing.efficiency_of(_key(mode, p.busiest_link))}
        for mode, p in predictions.items()
    }
    if args.json:
        print(
            json.dumps(
                {
                    "shape": args.cluster,
                    "link_mbit": args.link_mbit,
                    "node_link_mbit": args.node_link_mbit or args.link_mbit,
                    "params": params,
                    "compute_probe_s": compute_s,
                    "systems": rows,
                },
                indent=2,
            )
        )
        return 0
    print(
        f"{shape.worker_hosts} worker host(s) x {shape.workers_per_host}, {shape.node_hosts} node host(s), links {args.link_mbit:g} Mbit/s"
        + (f" (node hosts' {args.node_link_mbit:g})" if args.node_link_mbit else "")
        + "; "
        f"GPT of {params:,} parameters, {tokens:,} tokens per step; a worker's compute {compute_s * 1e3:.1f} ms here"
        + ("" if efficiency else "; no --cluster-calibration: ideal link rates (a lower bound on the step)")
    )
    print(f"{'system':<9} {'step s':>8} {'tokens/s':>10} {'compute s':>10} {'comm s':>8}  busiest link (efficiency)")
    for mode, row in rows.items():
        print(
            f"{mode:<9} {row['predicted_step_s']:>8.3f} {row['tokens_per_s']:>10.0f} {row['predicted_compute_s']:>10.3f} "
            f"{row['predicted_communication_s']:>8.3f}  {row['busiest_link']} ({row['efficiency']:.2f})"
        )
    fsdp = rows["fsdp"]["predicted_step_s"]
    print(f"netoptim / FSDP tokens/s: {fsdp / rows['netoptim']['predicted_step_s']:.2f}")
    return 0


def _key(mode: str, busiest: str) -> str:
    from netoptim.planning.cluster_model import bound_key

    return bound_key(mode, busiest)
