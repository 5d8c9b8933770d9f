"""``netoptim cluster``: train on an emulated cluster of hosts on this machine (network namespaces, a
bridge, links shaped with ``tc``), and ``--cleanup`` of what a killed run left. Needs root."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from netoptim.cli.arg_types import non_negative_int, positive_int

log = logging.getLogger(__name__)

SYSTEMS = ("netoptim", "fsdp", "ddp")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _systems(text: str) -> tuple[str, ...]:
    systems = tuple(part.strip() for part in text.split(",") if part.strip())
    if not systems or any(s not in SYSTEMS for s in systems):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {', '.join(SYSTEMS)}")
    return systems


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """The shape of the emulated cluster, its links, the model and the run (shared by ``netoptim bench cluster``)."""
    parser.add_argument("--worker-hosts", type=positive_int, default=2, help="emulated worker hosts, H (default: %(default)s)")
    parser.add_argument("--workers-per-host", type=positive_int, default=1, help="worker processes per worker host, G (default: %(default)s)")
    parser.add_argument("--node-hosts", type=positive_int, default=1, help="emulated optimizer-node hosts, N, one node each (default: %(default)s)")
    parser.add_argument(
        "--link-gbit", type=_positive_float, default=25.0, help="the target cluster's link rate per host, Gbit/s each way (default: %(default)s)"
    )
    parser.add_argument(
        "--node-link-gbit",
        type=_positive_float,
        default=None,
        help="the target's link rate per optimizer-node host, Gbit/s each way, scaled as --link-gbit (default: --link-gbit; CPU hosts often have a "
        "faster port, or two)",
    )
    parser.add_argument(
        "--target-tflops", type=_positive_float, default=100.0, help="the target GPU's effective TFLOP/s (default: %(default)s, an A100 in practice)"
    )
    parser.add_argument(
        "--emulated-mbit",
        type=_positive_float,
        default=None,
        help="run the worker hosts' links at this many Mbit/s instead of scaling the target's by this CPU's speed (the node hosts' at this "
        "times --node-link-gbit / --link-gbit)",
    )
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps (default: %(default)s)")
    parser.add_argument("--warmup", type=non_negative_int, default=1, help="untimed steps first (default: %(default)s)")
    parser.add_argument("--micro-batch", type=positive_int, default=8, help="sequences per worker per step (default: %(default)s)")
    parser.add_argument("--block-size", type=positive_int, default=64, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--n-layer", type=positive_int, default=2, help="transformer blocks of the GPT (default: %(default)s)")
    parser.add_argument("--n-embd", type=positive_int, default=128, help="width of the GPT (default: %(default)s)")
    parser.add_argument("--n-head", type=positive_int, default=4, help="attention heads of the GPT (default: %(default)s)")
    parser.add_argument(
        "--no-host-groups",
        action="store_true",
        help="netoptim with several workers per host: every worker pushes its own gradients (default: they sum them in shared memory first and "
        "one flow per host goes to each node)",
    )
    parser.add_argument("--bucket-numel", type=non_negative_int, default=0, help="netoptim: parameters per bucket (default: 0, the model in about 32 buckets)")
    parser.add_argument(
        "--pace-window-kib",
        type=non_negative_int,
        default=None,
        help="netoptim: KiB of gradients a pushing worker may have in flight whose new values have not come back; keeps the flows into a shared "
        "node link in step (default: 6 buckets' worth; 0: no window)",
    )
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads per worker process (default: %(default)s)")
    parser.add_argument("--subnet", default="10.231.0.0/24", help="private IPv4 range of the emulated hosts (default: %(default)s)")
    parser.add_argument("--timeout-s", type=positive_int, default=600, help="give up on a system's run after this long (default: %(default)s)")
    parser.add_argument(
        "--calibration",
        default="",
        metavar="REPORTS",
        help="comma-separated JSON reports of earlier runs on the same links: their measured link efficiencies go into the report's predicted step "
        "times (default: none, ideal links)",
    )


def add_cluster_parser(subparsers: argparse._SubParsersAction) -> None:
    cluster = subparsers.add_parser(
        "cluster",
        help="train on an emulated cluster: hosts as network namespaces, links shaped with tc (root)",
        description=(
            "Emulate H worker hosts x G workers and N optimizer-node hosts on this machine: each host a network namespace on a private bridge, "
            "each link shaped with tc in both directions. The link rate is the target's (--link-gbit) scaled by this CPU's speed against the "
            "target GPU's (--target-tflops), so compute and communication keep the target's proportions. Trains a small GPT, reports tokens/s and "
            "the bytes every link carried per step, and removes every namespace, veth and bridge afterwards. Needs root."
        ),
    )
    add_cluster_flags(cluster)
    cluster.add_argument("--systems", type=_systems, default=("netoptim",), help="comma-separated: netoptim, fsdp, ddp (default: netoptim)")
    cluster.add_argument("--json", action="store_true", help="print the report as JSON")
    cluster.add_argument("--cleanup", action="store_true", help="remove the namespaces, veths and bridges that runs no longer alive left, then exit")
    cluster.add_argument("--force", action="store_true", help="with --cleanup: also remove those of runs still going")


def cluster_run_from_args(args: argparse.Namespace, systems: tuple[str, ...]):
    """A :class:`netoptim.cluster.session.ClusterRun` from the flags of :func:`add_cluster_flags`."""
    from netoptim.cluster.report import Shape
    from netoptim.cluster.runner import JobSpec
    from netoptim.cluster.session import ClusterRun

    job = JobSpec(
        mode=systems[0],
        workers_per_host=args.workers_per_host,
        host_groups=not args.no_host_groups,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        block_size=args.block_size,
        micro_batch=args.micro_batch,
        warmup=args.warmup,
        steps=args.steps,
        threads=args.threads,
        timeout_s=args.timeout_s,
        bucket_numel=args.bucket_numel,
        pace_window_bytes=None if args.pace_window_kib is None else args.pace_window_kib * 1024,
    )
    efficiency: dict[str, float] = {}
    if args.calibration:
        from netoptim.cluster.prediction import CalibrationError, efficiencies_from_reports

        try:
            efficiency = efficiencies_from_reports(p for p in args.calibration.split(",") if p)
        except CalibrationError as exc:
            raise SystemExit(str(exc)) from None
    return ClusterRun(
        link_efficiency=efficiency,
        shape=Shape(args.worker_hosts, args.workers_per_host, args.node_hosts),
        job=job,
        modes=systems,
        target_link_gbit=args.link_gbit,
        target_tflops=args.target_tflops,
        emulated_mbit=args.emulated_mbit or 0.0,
        node_link_ratio=(args.node_link_gbit or args.link_gbit) / args.link_gbit,
        subnet=args.subnet,
    )


def run_cluster_command(args: argparse.Namespace) -> int:
    """``netoptim cluster``: exit 0 on success, 1 when not root or the run failed, 2 for bad settings."""
    if os.geteuid() != 0:
        print("netoptim cluster: needs root (it creates network namespaces, veths, a bridge and tc qdiscs); run it with sudo", file=sys.stderr)
        return 1
    from netoptim.cluster.cleanup import cleanup
    from netoptim.cluster.report import format_text
    from netoptim.cluster.session import run_cluster

    if args.cleanup:
        removed, skipped = cleanup(force=args.force)
        print("\n".join(f"removed {what}" for what in removed) or "nothing to remove")
        for prefix in skipped:
            print(f"left {prefix}: its run is still going (--force removes it anyway)")
        return 0
    try:
        report = run_cluster(cluster_run_from_args(args, args.systems))
    except ValueError as exc:
        log.error("netoptim cluster: %s", exc)
        return 2
    except (PermissionError, RuntimeError, TimeoutError, OSError) as exc:
        log.error("netoptim cluster failed: %s", exc)
        return 1
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return 0
