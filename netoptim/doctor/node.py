"""``netoptim doctor --node ADDRESS`` and ``--admin HOST:PORT``: whether a worker here reaches a
running node, and how well. The data plane is probed as a worker connects (CURVE where given): ECHO
messages, which the node sends straight back without touching any job, for the round trip and the
rate; when nothing comes back, the connection's own events say why. The admin service is asked for
its health and status: the node's version against this host's, its job, its update path."""

from __future__ import annotations

import ipaddress
import socket
import statistics
import time
from urllib.parse import urlsplit

import torch

from netoptim.doctor.findings import Finding
from transport import create_transport
from transport.interface import ClientEndpoint, Message
from transport.wire import ErrorCode, Header, MsgType, tensor_header
from transport.zeromq.security import CurveClientConfig

PINGS = 20
"""Empty ECHOs timed one after another: the median is the round trip."""
PROBE_PIECE = 4 << 20
"""Bytes an ECHO of the rate probe carries; at most :data:`PROBE_IN_FLIGHT` of them are out at once,
within a node's default ``--max-echo-bytes`` (16 MiB)."""
PROBE_IN_FLIGHT = 3


def _refusal(message: Message) -> str | None:
    """What an ERROR reply says, or ``None`` for any other message."""
    if message.header.msg_type != MsgType.ERROR:
        return None
    code = message.header.meta.get("code", 0)
    try:
        name = ErrorCode(code).name
    except ValueError:  # a code this version does not know (another version's node)
        name = str(code)
    return f"{name}: {message.header.meta.get('message', '')}"


def _await(client: ClientEndpoint, deadline: float) -> Message | None:
    while (left := deadline - time.monotonic()) > 0:
        message = client.recv(min(left, 0.25))
        if message is not None:
            return message
    return None


def _local_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine (it can be bound here)."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _name, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind((sockaddr[0], 0))
                return True
            except OSError:
                continue
    return False


def _address_problem(address: str) -> tuple[str, str] | None:
    """What is wrong with ``address`` before anything connects: ``(detail, fix)``, or ``None``."""
    parts = urlsplit(address)
    if parts.scheme == "ipc":
        return None
    if parts.scheme not in ("tcp", "mooncake"):
        return f"{address!r} is not a node's data address", 'give it as tcp://HOST:PORT (the "data" field of the node\'s ready file)'
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or not port:
        return f"{address!r} has no host or port", "give it as tcp://HOST:PORT"
    try:
        socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"the host {parts.hostname!r} does not resolve: {exc.strerror or exc}", "check the name (or give the node's IP address)"
    return None


def data_plane_findings(
    address: str, curve: CurveClientConfig | None, *, timeout_s: float, probe_bytes: int, exchange_bytes: int | None = None
) -> list[Finding]:
    """Connect to the node at ``address`` as a worker would and measure the path to it; ``exchange_bytes``:
    what a worker sends the node a step (and gets back), for the least time that takes at the rate measured."""
    area = f"node {address}"
    if (problem := _address_problem(address)) is not None:
        return [Finding(area, "address", "fail", *problem)]
    if curve is not None:
        try:
            curve.validate()
        except (OSError, ValueError) as exc:
            return [Finding(area, "curve keys", "fail", str(exc), "give --curve-secret-key the worker's .key_secret and --curve-server-key the node's .key")]
    transport = create_transport(address, **({"curve_client": curve} if curve else {}))
    client = transport.connect(address)
    try:
        return _probe(area, address, client, timeout_s=timeout_s, probe_bytes=probe_bytes, curve=curve is not None, exchange_bytes=exchange_bytes)
    finally:
        client.close()
        transport.close()


def _probe(area: str, address: str, client: ClientEndpoint, *, timeout_s: float, probe_bytes: int, curve: bool, exchange_bytes: int | None) -> list[Finding]:
    started = time.monotonic()
    client.send(Header(msg_type=MsgType.ECHO))
    reply = _await(client, started + timeout_s)
    if reply is None:
        state = client.link_state() or "no answer"
        return [Finding(area, "reachable", "fail", f"no answer in {timeout_s:g} s: {state}", _fix_for(client.link_problem(), curve))]
    if (refusal := _refusal(reply)) is not None:
        return [Finding(area, "reachable", "fail", f"the node refused an ECHO: {refusal}", "the same netoptim version here and on the node")]
    where = "on this host" if _on_this_host(address) else "on another host"
    found = [Finding(area, "reachable", "ok", f"answered in {1e3 * (time.monotonic() - started):.1f} ms ({'CURVE, ' if curve else ''}{where})")]
    rtts = []
    for _ in range(PINGS):
        sent = time.perf_counter()
        client.send(Header(msg_type=MsgType.ECHO))
        if _await(client, time.monotonic() + timeout_s) is None:
            return [
                *found,
                Finding(
                    area, "round trip", "fail", "an ECHO went unanswered after the first came back", "is the node stopping or stuck? (netoptim admin status)"
                ),
            ]
        rtts.append(time.perf_counter() - sent)
    found.append(
        Finding(
            area, "round trip", "ok", f"{1e3 * statistics.median(rtts):.3f} ms (median of {PINGS})", figures={"rtt_ms": round(1e3 * statistics.median(rtts), 4)}
        )
    )
    if probe_bytes:
        found.append(_rate(area, client, probe_bytes, timeout_s, exchange_bytes))
    return found


def _on_this_host(address: str) -> bool:
    parts = urlsplit(address)
    return parts.scheme == "ipc" or (parts.hostname is not None and _local_address(parts.hostname))


def _fix_for(problem: str | None, curve: bool) -> str:
    if problem is None:
        return "check that the node runs (netoptim admin status) and that no firewall drops this port"
    if "handshake" in problem:
        if curve:
            return "--curve-server-key must be the node's public key, and the node's --curve-allow directory must hold this worker's .key"
        return "give --curve-secret-key and --curve-server-key where the node uses CURVE"
    return 'start the node, or fix the host and port (the "data" field of its ready file)'


def _rate(area: str, client: ClientEndpoint, probe_bytes: int, timeout_s: float, exchange_bytes: int | None) -> Finding:
    """``probe_bytes`` pushed in pieces and echoed back, a few pieces in flight at once."""
    piece = torch.ones(min(PROBE_PIECE, probe_bytes) // 4, dtype=torch.float32)
    pieces = max(1, probe_bytes // (piece.numel() * 4))
    header = tensor_header(MsgType.ECHO, piece)
    started = time.perf_counter()
    sent = received = 0
    while received < pieces:
        while sent < pieces and sent - received < PROBE_IN_FLIGHT:
            client.send(header, piece)
            sent += 1
        reply = _await(client, time.monotonic() + timeout_s)
        if reply is None or (refusal := _refusal(reply)) is not None:
            why = "no echo came back" if reply is None else f"the node refused: {refusal}"
            return Finding(
                area, "rate", "warn", f"the rate probe stopped after {received} of {pieces} pieces: {why}", "measure again with --probe-bytes 0 to skip it"
            )
        received += 1
    seconds = time.perf_counter() - started
    moved = pieces * piece.numel() * 4
    gbs = moved / seconds / 1e9
    detail = f"{gbs:.2f} GB/s each way ({moved >> 20} MiB pushed and echoed back in {PROBE_PIECE >> 20} MiB pieces, {PROBE_IN_FLIGHT} in flight)"
    figures: dict[str, float | int | str | None] = {"gbs_each_way": round(gbs, 3)}
    if exchange_bytes:
        floor_s = exchange_bytes / (gbs * 1e9)  # the gradients out and the values back share no direction
        figures["exchange_seconds_per_step"] = round(floor_s, 3)
        detail += (
            f"; a worker's gradients for one node's share and its new values ({exchange_bytes / 1e9:.2f} GB each way) take at least {floor_s:.2f} s a step"
        )
    return Finding(area, "rate", "ok", detail, figures=figures)


def admin_findings(target: str, token: str | None, tls_ca: str | None, *, timeout_s: float, version: str) -> tuple[list[Finding], str | None]:
    """Health and status of the node whose admin service is at ``target``; also the node's data
    address as a worker here would dial it (``None`` where the status could not be read)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from netoptim.cli.admin import admin_channel
    from protos import admin_pb2, admin_pb2_grpc

    area = f"admin {target}"
    metadata = [("authorization", f"Bearer {token}")] if token else []
    with admin_channel(target, tls_ca) as channel:
        try:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            status = admin_pb2_grpc.OptimizerNodeAdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(), metadata=metadata, timeout=timeout_s)
        except grpc.RpcError as exc:
            return [Finding(area, "status", "fail", f"{exc.code().name}: {exc.details()}", _admin_fix(exc.code()))], None
    serving = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
    found = [
        Finding(
            area,
            "health",
            "ok" if serving == "SERVING" else "warn",
            serving,
            "" if serving == "SERVING" else "the node is stopping or not ready: netoptim admin status",
        )
    ]
    if status.version != version:
        found.append(
            Finding(
                area, "version", "warn", f"the node runs netoptim {status.version}, this host {version}", "the same netoptim version on every host of a job"
            )
        )
    else:
        found.append(Finding(area, "version", "ok", f"netoptim {status.version}, as here"))
    job = f"a job at step {status.step}, {status.world_size} workers ({status.job_state or 'running'})" if status.registered else "no job registered"
    detail = f"node {status.node_id!r}, up {status.uptime_seconds:.0f} s, {job}; updates with {status.update_path or 'unknown'}"
    found.append(Finding(area, "status", "ok", detail, figures={"node_id": status.node_id, "step": status.step}))
    return found, _dialable(status.data_address, target)


def _admin_fix(code: object) -> str:
    import grpc

    if code == grpc.StatusCode.UNAUTHENTICATED:
        return "give the node's admin token: --token-file FILE (or $NETOPTIM_ADMIN_TOKEN)"
    if code == grpc.StatusCode.UNAVAILABLE:
        return 'start the node with --admin HOST:PORT, or fix the address (the "admin" field of its ready file)'
    return "check the address, and --tls-ca where the node serves TLS"


def _dialable(data_address: str, admin_target: str) -> str | None:
    """The node's data address with a wildcard host (it listens on every interface) replaced by the
    host its admin service was reached at."""
    if not data_address:
        return None
    parts = urlsplit(data_address)
    try:
        wildcard = parts.hostname is not None and ipaddress.ip_address(parts.hostname).is_unspecified
    except ValueError:
        wildcard = False
    if not wildcard:
        return data_address
    host = admin_target.rpartition(":")[0]
    return f"{parts.scheme}://{host}:{parts.port}"
