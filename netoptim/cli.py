"""The ``netoptim`` command: ``node`` runs an optimizer-node daemon, ``demo`` trains a small GPT on this
machine, ``bench`` measures. Every flag is explained by ``netoptim SUBCOMMAND --help``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from netoptim.admin_cli import TOKEN_ENV, add_admin_parser, run_admin
from netoptim.arg_types import address, non_negative_int, positive_int, size
from netoptim.bench_cli import add_bench_parser
from netoptim.plan_cli import add_plan_parser, run_plan

log = logging.getLogger("netoptim")


def _add_node_parser(subparsers: argparse._SubParsersAction) -> None:
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


def _add_demo_parser(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="train a small GPT on this machine: nodes and workers all local",
        description="Start optimizer node(s) and worker processes on this machine and train a small GPT-style byte-level language model on the Python standard library's own source files. No GPU needed.",
    )
    demo.add_argument("--steps", type=positive_int, default=600, help="training steps (default: %(default)s)")
    demo.add_argument("--workers", type=positive_int, default=2, help="data-parallel worker processes (default: %(default)s)")
    demo.add_argument("--nodes", type=positive_int, default=1, help="optimizer-node processes (default: %(default)s)")
    demo.add_argument(
        "--wire-dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="dtype of gradients and parameters on the wire (default: %(default)s)",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed of the model and the data order (default: %(default)s)")
    demo.add_argument("--layerwise", action="store_true", help="layer-wise mode: workers stream the blocks from the nodes instead of holding the model")


def _count(text: str) -> int:
    """A parameter count like 3B, 85M, 1.3e9 or 125000000."""
    scale = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
    stripped = text.strip().lower()
    factor = scale.get(stripped[-1:], 1)
    try:
        value = int(float(stripped[:-1] if factor > 1 else stripped) * factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count like 3B, 85M or 125000000") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _add_plan_memory_parser(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser(
        "plan-memory",
        help="RAM and disk each optimizer node needs for a model, before starting anything",
        description="Print what each node needs for its share of a job: RAM in memory, RAM and disk out of core (--state-dir/--memory-budget), so you know before you start. Nodes check the same figures when a job registers and refuse one they cannot hold.",
    )
    plan.add_argument("--params", type=_count, required=True, help="trainable parameters of the model, like 3B, 85M or 125000000")
    plan.add_argument("--workers", type=positive_int, required=True, help="data-parallel workers")
    plan.add_argument("--nodes", type=positive_int, default=1, help="optimizer nodes sharing the state (default: %(default)s)")
    plan.add_argument(
        "--wire-dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="gradient/parameter dtype on the wire (default: %(default)s)"
    )
    plan.add_argument("--layerwise", action="store_true", help="workers run layer-wise mode (their push window bounds the gradients a node holds)")
    plan.add_argument("--push-window", type=size, default=1 << 30, help="layer-wise: unconsumed gradient bytes per worker (default: 1GiB)")
    plan.add_argument("--memory-budget", type=size, default=None, help="out of core: the node's --memory-budget, e.g. 4GiB")
    plan.add_argument("--keep", type=non_negative_int, default=0, help="checkpoints kept on the same disk as the state (default: %(default)s)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run_plan_memory(args: argparse.Namespace) -> int:
    import json

    from optimizer_node.memory_plan import available_memory, node_needs

    share = -(-args.params // args.nodes)
    wire_bytes = 4 if args.wire_dtype == "float32" else 2
    needs = node_needs(
        share,
        workers=args.workers,
        wire_bytes=wire_bytes,
        layerwise=args.layerwise,
        push_window_bytes=args.push_window,
        memory_budget=args.memory_budget,
        keep_checkpoints=args.keep,
    )
    available = available_memory()
    if args.json:
        print(json.dumps({"nodes": args.nodes, "per_node": needs.to_dict(), "this_host_available_ram": available}, indent=2))
        return 0
    gib = 2**30
    print(f"{args.params:,} parameters over {args.nodes} node(s): about {share:,} per node, {args.workers} workers, {args.wire_dtype} on the wire")
    print(f"  in memory:   {needs.ram_in_memory / gib:8.1f} GiB RAM per node")
    if needs.ram_out_of_core is not None:
        print(f"  out of core: {needs.ram_out_of_core / gib:8.1f} GiB RAM per node with --memory-budget {args.memory_budget / gib:.1f}GiB")
    print(f"               {needs.disk_out_of_core / gib:8.1f} GiB disk per node under --state-dir (live state + {args.keep} checkpoint(s))")
    if available is not None:
        verdict = "fits" if needs.ram_in_memory <= available else "does NOT fit: use --state-dir/--memory-budget or more nodes"
        print(f"  this host has {available / gib:.1f} GiB available: in memory {verdict}")
    return 0


def _add_keygen_parser(subparsers: argparse._SubParsersAction) -> None:
    keygen = subparsers.add_parser(
        "keygen",
        help="make a CURVE key pair for the data plane",
        description="Write NAME.key (public: give it to peers; a node's allow-list is a directory of workers' .key files) and NAME.key_secret (keep it private) into DIR.",
    )
    keygen.add_argument("--dir", required=True, help="where to write the two files")
    keygen.add_argument("--name", required=True, help="base name of the files, e.g. node0 or worker3")


def run_keygen(args: argparse.Namespace) -> int:
    from transport.security import generate_keypair

    public, secret = generate_keypair(args.dir, args.name)
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    return 0


def _add_export_parser(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser(
        "export",
        help="merge the nodes' checkpoints into one model state dict",
        description="Merge the checkpoints of all of a job's nodes (same step) into one ordinary state dict with the model's parameter names, loadable with model.load_state_dict.",
    )
    export.add_argument("--to", required=True, metavar="FILE", help="output file, ending in .safetensors or .pt")
    export.add_argument(
        "checkpoints",
        nargs="+",
        metavar="CHECKPOINT",
        help="one per node: a checkpoint directory (step-N), or a node's --checkpoint-dir for its newest intact checkpoint",
    )


def run_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from optimizer_node.checkpoint import CheckpointError, resolve
    from optimizer_node.export import export

    try:
        checkpoints = [resolve(Path(path)) for path in args.checkpoints]
        step, numel = export(checkpoints, Path(args.to))
    except (CheckpointError, ValueError, OSError) as exc:
        log.error("export failed: %s", exc)
        return 1
    print(f"exported step {step}: {numel:,} parameters from {len(checkpoints)} node checkpoint(s) to {args.to}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="netoptim", description="netoptim: train models larger than their GPUs with the optimizer on CPU nodes in the network."
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging verbosity (default: %(default)s)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{node,demo,bench,plan,plan-memory,admin,export,keygen}")
    _add_node_parser(subparsers)
    _add_demo_parser(subparsers)
    add_bench_parser(subparsers)
    _add_plan_memory_parser(subparsers)
    add_plan_parser(subparsers)
    add_admin_parser(subparsers)
    _add_export_parser(subparsers)
    _add_keygen_parser(subparsers)
    return parser


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


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``netoptim`` command; returns its exit status."""
    return _run_command(build_parser().parse_args(argv))


def console() -> NoReturn:
    """The ``netoptim`` command and ``python -m netoptim``."""
    args = build_parser().parse_args()
    code = _run_command(args)
    if args.command != "node":
        sys.exit(code)
    # A stopped node has closed its sockets, its store and its last checkpoint by now; what is left
    # is the interpreter tearing torch's modules down, ~0.4 s of every stop that frees nothing the
    # OS would not. Flush what is buffered and end the process here.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.command == "node":
        return run_node(args)
    if args.command == "demo":
        from netoptim.launcher import run_demo

        return run_demo(args)
    if args.command == "keygen":
        return run_keygen(args)
    if args.command == "export":
        return run_export(args)
    if args.command == "admin":
        return run_admin(args)
    if args.command == "plan-memory":
        return run_plan_memory(args)
    if args.command == "plan":
        return run_plan(args)
    if args.command == "bench":
        from benchmarks import run_benchmark

        return run_benchmark(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
