"""``netoptim doctor``: check a host before a run, and the nodes a worker here would use.

Everything a run would otherwise find out late, each with what to do: the software and the CPUs,
memory and huge pages a node gets here, whether its compiled update runs bitwise here; a state
directory's file system, free space and disk rate; for each node, whether a worker here reaches it
(and if not, why: nothing listens, a CURVE key mismatch, a host that never answers), its round trip
and rate; for each admin address, the node's health, version and job. Exit status 1 when anything
found stops a run.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from netoptim.arg_types import non_negative_int, param_count, positive_int, size, size_or_zero
from netoptim.doctor_findings import Finding, as_json, as_text, failed

log = logging.getLogger(__name__)

DEFAULT_PROBE_BYTES = 64 << 20


def add_doctor_parser(subparsers: argparse._SubParsersAction) -> None:
    doctor = subparsers.add_parser(
        "doctor",
        help="check this host, a state directory and the nodes a worker here would use, before a run",
        description="Check what a run needs and say what to fix: this host (software, CPUs, memory, the node's update path, huge pages, "
        "open files, GPUs), a node's --state-dir (file system, free space, disk rate), and each node given (reachable from here as a "
        "worker connects, and if not why; round trip; rate; its admin service's health, version and job). With --params, the checks "
        "measure against what one node needs for that job. Exit status 0 when nothing stops a run, 1 when something does.",
    )
    doctor.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="ADDRESS",
        help='a node\'s data address, as workers dial it (tcp://HOST:PORT, the "data" field of its ready file); repeat for each node',
    )
    doctor.add_argument(
        "--admin",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a node's admin address: its health, version and job, and its data address is probed as --node is; repeat for each node",
    )
    doctor.add_argument("--token-file", default=None, metavar="FILE", help="the nodes' admin token, for --admin (default: $NETOPTIM_ADMIN_TOKEN)")
    doctor.add_argument("--tls-ca", default=None, metavar="PEM", help="--admin over TLS, trusting this CA certificate")
    doctor.add_argument("--curve-secret-key", default=None, metavar="FILE", help="the worker's CURVE .key_secret, where the nodes use CURVE")
    doctor.add_argument("--curve-server-key", default=None, metavar="FILE", help="the nodes' CURVE public .key (with --curve-secret-key)")
    doctor.add_argument("--state-dir", default=None, metavar="DIR", help="an out-of-core node's --state-dir: file system, free space, disk rate")
    doctor.add_argument("--params", type=param_count, default=None, help="check for a job of this many parameters, like 1.3B (memory, disk)")
    doctor.add_argument("--workers", type=positive_int, default=1, help="with --params: the job's data-parallel workers (default: %(default)s)")
    doctor.add_argument("--nodes", type=positive_int, default=1, help="with --params: the nodes sharing its state (default: %(default)s)")
    doctor.add_argument(
        "--wire-dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="with --params: the wire dtype (default: %(default)s)"
    )
    doctor.add_argument("--layerwise", action="store_true", help="with --params: workers run layer-wise (their push window bounds a node's gradients)")
    doctor.add_argument("--memory-budget", type=size, default=None, metavar="SIZE", help="with --params: the nodes' --memory-budget, e.g. 4GiB")
    doctor.add_argument("--keep", type=non_negative_int, default=0, help="with --params: checkpoints kept on the state's disk (default: %(default)s)")
    doctor.add_argument(
        "--probe-bytes",
        type=size_or_zero,
        default=DEFAULT_PROBE_BYTES,
        metavar="SIZE",
        help="bytes of the disk and node rate probes (default: 64MiB; 0 skips every measurement, the update rate's too)",
    )
    doctor.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="how long to wait for a node's answer (default: %(default)s)")
    doctor.add_argument("--no-host", action="store_true", help="skip this host's own checks (only the state directory and the nodes)")
    doctor.add_argument("--json", action="store_true", help="print JSON: the findings, each with its figures, and a count per level")


def _plan(args: argparse.Namespace):  # -> JobPlan | None
    from netoptim.doctor_host import JobPlan
    from optimizer_node.memory_plan import node_needs

    if args.params is None:
        return None
    share = -(-args.params // args.nodes)
    needs = node_needs(
        share,
        workers=args.workers,
        wire_bytes=4 if args.wire_dtype == "float32" else 2,
        layerwise=args.layerwise,
        memory_budget=args.memory_budget,
        keep_checkpoints=args.keep,
    )
    return JobPlan(args.params, args.workers, args.nodes, args.keep, needs)


def run_doctor(args: argparse.Namespace) -> int:
    from netoptim.admin_cli import admin_token
    from netoptim.doctor_disk import state_dir_findings
    from netoptim.doctor_host import host_findings, package_version
    from netoptim.doctor_node import admin_findings, data_plane_findings
    from transport.security import CurveClientConfig

    if (args.curve_secret_key is None) != (args.curve_server_key is None):
        log.error("doctor: give --curve-secret-key and --curve-server-key together")
        return 2
    if args.timeout <= 0:
        log.error("doctor: --timeout must be positive")
        return 2
    try:
        token = admin_token(args.token_file, None)
    except ValueError as exc:
        log.error("doctor: %s", exc)
        return 2
    plan = _plan(args)
    findings: list[Finding] = (
        [] if args.no_host else host_findings(plan, args.memory_budget, measure=args.probe_bytes > 0, wire_bytes=4 if args.wire_dtype == "float32" else 2)
    )
    if args.state_dir:
        findings += state_dir_findings(Path(args.state_dir), plan, args.memory_budget, args.probe_bytes)
    addresses = list(args.node)
    for target in args.admin:
        found, data_address = admin_findings(target, token, args.tls_ca, timeout_s=args.timeout, version=package_version("netoptim"))
        findings += found
        if data_address and data_address not in addresses:
            addresses.append(data_address)
    curve = CurveClientConfig(args.curve_secret_key, args.curve_server_key) if args.curve_secret_key else None
    for address in addresses:
        exchange = None if plan is None else -(-args.params // args.nodes) * (4 if args.wire_dtype == "float32" else 2)
        findings += data_plane_findings(address, curve, timeout_s=args.timeout, probe_bytes=args.probe_bytes, exchange_bytes=exchange)
    print(as_json(findings) if args.json else as_text(findings))
    return 1 if failed(findings) else 0
