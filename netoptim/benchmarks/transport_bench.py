"""``netoptim bench transport``: push+pull through a real node against a plain TCP socket, same run.

Both sides move ``--bytes`` of gradients as messages of ``--bucket-bytes`` (one bucket each), all
pushed back to back while the answers stream back, as a worker's step does:

- netoptim: a worker endpoint sends each bucket to a ``netoptim node`` process, whose ECHO handler
  sends the received frames straight back (no copy), so the figure is the transport's alone;
- baseline: one plain TCP socket to an echo process that reads each bucket with ``recv_into`` into
  a preallocated buffer and writes it back with ``sendall``; the client sends from one thread and
  receives into a preallocated buffer in another.

The figure is (bytes pushed + bytes pulled) / time, over loopback; ``ratio`` is netoptim over the
chosen backend against the plain socket. ``--backend zmq`` (ZeroMQ over tcp://) also measures the
node's same-host ipc:// socket with payloads in shared windows (``same_host_ratio``, what a worker on
the node's host uses; ``same_host_shared_fraction`` of the pushed bytes went through the windows) and
with payloads on that socket (``same_host_socket_only_ratio``), and, with
``--curve``, the cost of encryption; ``--backend mooncake`` measures the Mooncake Transfer Engine
over its tcp protocol (one-sided writes into the peer's registered window, headers over ZeroMQ).
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import tempfile
import threading
from pathlib import Path

import torch

from netoptim.benchmarks.common import median_seconds
from netoptim.launch.processes import NodeProcess
from transport import create_transport
from transport.wire import MsgType, tensor_header
from transport.zeromq.security import CurveClientConfig, generate_keypair


def _echo_server(listener: socket.socket, bucket_bytes: int, messages: int) -> None:
    connection, _ = listener.accept()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(bytearray(bucket_bytes))
    for _ in range(messages):
        received = 0
        while received < bucket_bytes:
            count = connection.recv_into(view[received:], bucket_bytes - received)
            if count == 0:
                return
            received += count
        connection.sendall(view)
    connection.close()


def raw_socket_seconds(nbytes: int, bucket_bytes: int, repeats: int) -> float:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    buckets = nbytes // bucket_bytes
    server = multiprocessing.get_context("fork").Process(target=_echo_server, args=(listener, bucket_bytes, buckets * (repeats + 1)), daemon=True)
    server.start()
    client = socket.create_connection(listener.getsockname())
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload, back = memoryview(bytearray(nbytes)), memoryview(bytearray(nbytes))

    def push_all() -> None:
        for start in range(0, nbytes, bucket_bytes):
            client.sendall(payload[start : start + bucket_bytes])

    def round_trip() -> None:
        sender = threading.Thread(target=push_all)
        sender.start()
        received = 0
        while received < nbytes:
            received += client.recv_into(back[received:], nbytes - received)
        sender.join()

    try:
        return median_seconds(round_trip, repeats, label="plain TCP socket")
    finally:
        client.close()
        listener.close()
        server.join(10)


def netoptim_seconds(
    nbytes: int,
    bucket_bytes: int,
    repeats: int,
    *,
    backend: str = "zmq",
    curve: bool = False,
    same_host: bool = False,
    connections: int = 1,
    shared_memory: bool = True,
) -> tuple[float, dict]:
    """Push+pull through a node over its tcp:// (or mooncake://) address, or its same-host ipc://
    socket (payloads in shared windows, or with ``shared_memory=False`` on the socket); returns the
    median seconds and what the client endpoint counted (mooncake; bytes through shared windows)."""
    buckets = [torch.ones(bucket_bytes // 4) for _ in range(nbytes // bucket_bytes)]
    with tempfile.TemporaryDirectory() as workdir:
        node_args: tuple[str, ...] = ()
        client_curve = None
        if curve:
            keys, allowed = Path(workdir) / "keys", Path(workdir) / "allowed"
            generate_keypair(str(keys), "node")
            generate_keypair(str(allowed), "worker")
            node_args = ("--curve-secret-key", str(keys / "node.key_secret"), "--curve-allow", str(allowed))
            client_curve = CurveClientConfig(str(allowed / "worker.key_secret"), str(keys / "node.key"))
        listen = "mooncake://127.0.0.1:0" if backend == "mooncake" else "tcp://127.0.0.1:0"
        node_args += ("--io-threads", str(connections))  # one I/O thread per lane on the node's side too
        node_args += ("--max-echo-bytes", str(nbytes))  # every bucket is pushed before the first echo is read
        with NodeProcess(workdir, log_level="WARNING", listen=listen, extra_args=node_args) as node:
            address = node.same_host_address if same_host else node.address
            where = (", same host" + ("" if shared_memory else ", socket only")) if same_host else ""
            label = f"netoptim push+pull ({backend}" + (", CURVE" if curve else "") + where + f", {connections} conn.)"
            return _measure_node(address, buckets, repeats, client_curve, label, connections, shared_memory)


def _measure_node(
    address: str, buckets: list[torch.Tensor], repeats: int, curve: CurveClientConfig | None, label: str, connections: int, shared_memory: bool = True
) -> tuple[float, dict]:
    options: dict = {"curve_client": curve} if curve else {}
    if connections > 1:
        options["connections_per_peer"] = connections
    if address.startswith("ipc://"):
        options["shared_memory"] = shared_memory
    transport = create_transport(address, **options)
    client = transport.connect(address)
    headers = [tensor_header(MsgType.ECHO, bucket, step=index, bucket_id=index) for index, bucket in enumerate(buckets)]

    def round_trip() -> None:
        for header, bucket in zip(headers, buckets, strict=True):
            client.send(header, bucket)
        for _ in buckets:
            message = client.recv(60)
            assert message is not None and message.header.numel == buckets[0].numel(), "the node did not echo"

    try:
        seconds = median_seconds(round_trip, repeats, label=label)
        counters = {name: getattr(client, name) for name in ("written_bytes", "staged_bytes", "inline_bytes") if hasattr(client, name)}
        shared = getattr(client, "shared", None)
        if shared is not None and shared.connection is not None:
            counters["shared_written_bytes"] = shared.connection.writer.written_bytes
        return seconds, counters
    finally:
        client.close()
        transport.close()


def run(args: argparse.Namespace) -> dict:
    if args.bucket_bytes % 4 or args.bytes % args.bucket_bytes:
        raise SystemExit("--bytes must be a multiple of --bucket-bytes, which must be a multiple of 4")
    if args.curve and args.backend != "zmq":
        raise SystemExit("--curve applies to --backend zmq only (the mooncake backend does not encrypt)")
    if args.connections > 1 and args.backend != "zmq":
        raise SystemExit("--connections applies to --backend zmq (the Mooncake engine opens its own: MC_TCP_LANES_PER_PEER)")
    netoptim_s, counters = netoptim_seconds(args.bytes, args.bucket_bytes, args.repeats, backend=args.backend, connections=args.connections)
    socket_s = raw_socket_seconds(args.bytes, args.bucket_bytes, args.repeats)
    netoptim_gbs, socket_gbs = 2 * args.bytes / netoptim_s / 1e9, 2 * args.bytes / socket_s / 1e9
    report = {
        "benchmark": "transport",
        "ratio": round(netoptim_gbs / socket_gbs, 3),
        "backend": args.backend,
        "connections": args.connections,
        "bytes": args.bytes,
        "bucket_bytes": args.bucket_bytes,
        "repeats": args.repeats,
        "netoptim_push_pull_gbs": round(netoptim_gbs, 2),
        "plain_socket_gbs": round(socket_gbs, 2),
        "netoptim_ms": round(netoptim_s * 1e3, 2),
        "plain_socket_ms": round(socket_s * 1e3, 2),
    }
    if counters:
        report["client_bytes"] = counters  # mooncake: written one-sided / of those staged / sent inline
    if args.backend == "zmq":
        same_host_s, same_host_counters = netoptim_seconds(args.bytes, args.bucket_bytes, args.repeats, same_host=True)
        ipc_s, _ = netoptim_seconds(args.bytes, args.bucket_bytes, args.repeats, same_host=True, shared_memory=False)
        same_host_gbs, ipc_gbs = 2 * args.bytes / same_host_s / 1e9, 2 * args.bytes / ipc_s / 1e9
        pushed = args.bytes * (args.repeats + 1)  # the warm-up round and the timed ones
        report |= {
            "netoptim_same_host_push_pull_gbs": round(same_host_gbs, 2),
            "same_host_ratio": round(same_host_gbs / socket_gbs, 3),
            "same_host_shared_fraction": round(same_host_counters.get("shared_written_bytes", 0) / pushed, 3),
            "netoptim_same_host_socket_only_gbs": round(ipc_gbs, 2),
            "same_host_socket_only_ratio": round(ipc_gbs / socket_gbs, 3),
        }
    if args.curve:
        curve_s, _ = netoptim_seconds(args.bytes, args.bucket_bytes, args.repeats, curve=True)
        curve_gbs = 2 * args.bytes / curve_s / 1e9
        report |= {
            "netoptim_curve_push_pull_gbs": round(curve_gbs, 2),
            "curve_ratio": round(curve_gbs / socket_gbs, 3),
            "curve_cost": round(1 - curve_gbs / netoptim_gbs, 3),
        }
    return report
