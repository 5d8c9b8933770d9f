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
import math
from pathlib import Path

from netoptim.cli.arg_types import size_or_zero
from netoptim.cli.job_size_args import add_job_size_arguments, job_size
from netoptim.doctor.findings import Finding, as_json, as_text, failed

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
    add_job_size_arguments(doctor, optional=True)
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


def run_doctor(args: argparse.Namespace) -> int:
    import netoptim
    from netoptim.cli.admin import admin_token
    from netoptim.doctor.disk import state_dir_findings
    from netoptim.doctor.host import host_findings
    from netoptim.doctor.node import admin_findings, data_plane_findings
    from transport.zeromq.security import CurveClientConfig

    if (args.curve_secret_key is None) != (args.curve_server_key is None):
        log.error("doctor: give --curve-secret-key and --curve-server-key together")
        return 2
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        log.error("doctor: --timeout must be a positive number of seconds, not %s", args.timeout)
        return 2
    if args.no_host and not (args.state_dir or args.node or args.admin):
        log.error("doctor: --no-host leaves nothing to check: give --state-dir, --node or --admin")
        return 2
    if (args.token_file or args.tls_ca) and not args.admin:
        log.error("doctor: --token-file and --tls-ca apply to --admin: give the node's admin address")
        return 2
    if args.curve_secret_key and not (args.node or args.admin):
        log.error("doctor: the CURVE keys apply to the nodes probed: give --node or --admin")
        return 2
    try:
        token = admin_token(args.token_file, None)
        plan = job_size(args)
    except ValueError as exc:
        log.error("doctor: %s", exc)
        return 2
    findings: list[Finding] = [] if args.no_host else host_findings(plan, measure=args.probe_bytes > 0)
    if args.state_dir:
        findings += state_dir_findings(Path(args.state_dir), plan, args.probe_bytes)
    addresses = list(args.node)
    for target in args.admin:
        found, data_address = admin_findings(target, token, args.tls_ca, timeout_s=args.timeout, version=netoptim.__version__)
        findings += found
        if data_address and data_address not in addresses:
            addresses.append(data_address)
    curve = CurveClientConfig(args.curve_secret_key, args.curve_server_key) if args.curve_secret_key else None
    exchange = None if plan is None else plan.share * plan.wire_bytes
    for address in addresses:
        findings += data_plane_findings(address, curve, timeout_s=args.timeout, probe_bytes=args.probe_bytes, exchange_bytes=exchange)
    print(as_json(findings) if args.json else as_text(findings))
    return 1 if failed(findings) else 0
