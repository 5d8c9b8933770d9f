"""``netoptim node``: its flags, the one place they become a :class:`~optimizer_node.NodeConfig`, and
running the daemon with its admin and metrics servers until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import threading

from netoptim.admin_cli import TOKEN_ENV
from netoptim.arg_types import address, non_negative_int, positive_int, size

log = logging.getLogger("netoptim")


def add_node_parser(subparsers: argparse._SubParsersAction) -> None:
    node = subparsers.add_parser(
        "node",
        help="run an optimizer-node daemon",
        description="Run an optimizer node: it holds the fp32 master parameters and AdamW state of the buckets it owns, sums the workers' gradients, applies the update and sends the new parameters back. Stops cleanly on SIGTERM or SIGINT.",
    )
    node.add_argument(
        "--listen",
        type=address,
        default="tcp://127.0.0.1:0",
        help="data-plane address to bind, tcp://HOST:PORT or ipc://PATH; port 0 lets the OS choose (default: %(default)s)",
    )
    node.add_argument(
        "--no-same-host-ipc",
        dest="same_host_ipc",
        action="store_false",
        help="do not also listen on an ipc:// socket in the temporary directory (by default workers on this host switch to it after their HELLO: no TCP stack)",
    )
    node.add_argument("--ready-file", help='write {"data": ADDRESS, "pid": PID} here as JSON once the node accepts work')
    node.add_argument("--node-id", default="", help="a name for this node in logs (default: its address)")
    node.add_argument("--max-message-bytes", type=size, default=None, help="largest tensor payload accepted in one message, e.g. 2GiB (default: 2GiB)")
    node.add_argument("--chunk-bytes", type=size, default=None, help="size of the frames outgoing tensors are split into (default: 4MiB)")
    node.add_argument(
        "--io-threads",
        type=positive_int,
        default=1,
        help="I/O threads moving the data plane's bytes; give the connections per node your workers open (default: %(default)s)",
    )
    node.add_argument("--threads", type=positive_int, default=None, help="CPU threads for the update kernels (default: torch's choice)")
    node.add_argument(
        "--checkpoint-dir", default=None, help="directory for crash-safe checkpoints (one subdirectory per checkpoint); without it none are taken"
    )
    node.add_argument(
        "--checkpoint-every",
        type=non_negative_int,
        default=0,
        help="checkpoint every N steps; 0: only on request, on drain and on SIGTERM (default: %(default)s)",
    )
    node.add_argument("--keep", type=positive_int, default=3, help="complete checkpoints to keep; older ones are removed (default: %(default)s)")
    node.add_argument(
        "--resume",
        action="store_true",
        help="start from the newest intact checkpoint in --checkpoint-dir (damaged ones are skipped); workers that reconnect continue from its step",
    )
    node.add_argument(
        "--curve-secret-key",
        default=None,
        metavar="FILE",
        help="the node's CURVE .key_secret file (netoptim keygen): encrypt the data plane and admit only allowed workers",
    )
    node.add_argument(
        "--curve-allow", default=None, metavar="DIR", help="directory of the .key files of the workers allowed to connect (with --curve-secret-key)"
    )
    node.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="out-of-core mode: keep parameters and AdamW state in files here (scratch space, cleared at start; put it on a fast local disk, on the checkpoint directory's filesystem so checkpoints are hard links)",
    )
    node.add_argument(
        "--memory-budget", type=size, default=None, metavar="SIZE", help="out-of-core mode: at most this much state in memory, e.g. 4GiB (with --state-dir)"
    )
    node.add_argument(
        "--sync-state-writes",
        action="store_true",
        help="out-of-core mode: fdatasync every state write and drop it from the page cache (bounded page cache, disk-speed updates)",
    )
    node.add_argument(
        "--crash-at", metavar="POINT:N", default=None, help="testing only: exit abruptly the N-th time the node passes POINT (push, update or checkpoint)"
    )
    node.add_argument(
        "--metrics-port",
        type=non_negative_int,
        default=None,
        help='serve Prometheus metrics at http://HOST:PORT/metrics (0: the OS picks; the URL goes into the ready file as "metrics")',
    )
    node.add_argument("--metrics-host", default="127.0.0.1", help="interface for --metrics-port (default: %(default)s)")
    node.add_argument(
        "--admin",
        metavar="HOST:PORT",
        default=None,
        help='serve the gRPC admin service here (port 0: the OS picks; the address goes into the ready file as "admin"); bind to 127.0.0.1 unless the network is trusted or a token is set',
    )
    node.add_argument("--tls-cert", default=None, help="PEM certificate for the admin service; with --tls-key it speaks TLS only")
    node.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    node.add_argument(
        "--admin-token", default=None, help=f"require 'authorization: Bearer TOKEN' on admin calls (health checks excepted); default: ${TOKEN_ENV} if set"
    )


def node_config_from_args(args: argparse.Namespace):  # -> NodeConfig, imported lazily to keep --help fast
    """The one place where flags become a :class:`NodeConfig`."""
    from optimizer_node import NodeConfig

    config = NodeConfig(
        listen=args.listen,
        same_host_ipc=args.same_host_ipc,
        ready_file=args.ready_file,
        node_id=args.node_id,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep=args.keep,
        resume=args.resume,
        crash_at=args.crash_at,
        curve_secret_key=args.curve_secret_key,
        curve_allow=args.curve_allow,
        state_dir=args.state_dir,
        memory_budget=args.memory_budget,
        sync_state_writes=args.sync_state_writes,
        io_threads=args.io_threads,
    )
    if args.max_message_bytes is not None:
        config.max_message_bytes = args.max_message_bytes
    if args.chunk_bytes is not None:
        config.chunk_bytes = args.chunk_bytes
    return config


def admin_config_from_args(args: argparse.Namespace):  # -> AdminConfig | None
    """The admin service's settings, or ``None`` when ``--admin`` is not given."""
    if args.admin is None:
        return None
    from optimizer_node.admin import AdminConfig

    host, sep, port = args.admin.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--admin {args.admin!r} must be HOST:PORT, like 127.0.0.1:0")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    return AdminConfig(address=args.admin, token=args.admin_token or os.environ.get(TOKEN_ENV) or None, tls_cert=args.tls_cert, tls_key=args.tls_key)


def run_node(args: argparse.Namespace) -> int:
    import torch

    from optimizer_node import NodeDaemon
    from optimizer_node.faults import CrashPoints

    config = node_config_from_args(args)
    try:
        config.validate()
        CrashPoints(config.crash_at)  # validates the spelling before anything starts
        admin_config = admin_config_from_args(args)
    except ValueError as exc:
        log.error("invalid node configuration: %s", exc)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    log.info("node config: %s (torch threads: %d)", dataclasses.asdict(config), torch.get_num_threads())
    try:
        daemon = NodeDaemon(config)
    except Exception as exc:  # a bad address, a port in use: say so and exit non-zero
        log.error("cannot start the node on %s: %s", config.listen, exc)
        return 1
    admin = None
    if admin_config is not None:
        from optimizer_node.admin import AdminServer

        try:
            admin = AdminServer(daemon, admin_config).start()
        except (OSError, RuntimeError, ValueError) as exc:
            log.error("cannot start the admin service on %s: %s", admin_config.address, exc)
            daemon.close()
            return 1
    metrics = None
    if args.metrics_port is not None:
        from optimizer_node.metrics import MetricsServer

        try:
            metrics = MetricsServer(daemon.metrics, args.metrics_host, args.metrics_port).start()
        except OSError as exc:
            log.error("cannot serve metrics on %s:%s: %s", args.metrics_host, args.metrics_port, exc)
            daemon.close()
            return 1
        daemon.metrics_address = metrics.address
    stop = threading.Event()

    def request_stop(signum: int, _frame: object) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        daemon.serve(stop)
    finally:
        if admin is not None:
            admin.stop()
        if metrics is not None:
            metrics.stop()
    return 0
