"""ZeroMQ backend: ROUTER on the node, one DEALER per worker-to-node connection, ``tcp://`` or ``ipc://``.

Frames at or above ``ZERO_COPY_BYTES`` are sent without a copy and tracked one by one (pyzmq tracks
only the last frame of a multipart send), so callers can know when a buffer may be reused.

A client may open several connections (*lanes*) to one node, for links one TCP stream cannot fill.
Each lane is a DEALER socket whose routing id is the client's id plus its lane number and the lane
count, so the node's ROUTER sees one peer. A message about bucket ``b`` takes lane ``b % lanes`` in
both directions and every other message lane 0: messages about one bucket keep their order, as do
all messages about none; messages about different buckets may pass each other.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import socket as sockets
import stat
import struct
import tempfile
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from transport.interface import ClientEndpoint, Message, SendHandle, ServerEndpoint, Transport
from transport.security import CurveClientConfig, CurveServerConfig, secure_client_socket, secure_server_socket
from transport.wire import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_HEADER_BYTES,
    ErrorCode,
    Header,
    Payload,
    WireError,
    decode_header,
    encode_message,
    payload_views,
)

log = logging.getLogger(__name__)

ZERO_COPY_BYTES = 64 << 10
"""pyzmq copies smaller frames anyway; tracking them would only cost time."""

NODE_RCVHWM = 32
"""Messages ZeroMQ reads ahead from one peer (per connection) before it stops reading that peer's socket
(TCP flow control then holds the peer back). Unbounded, a peer that sends faster than the node handles
grows the node by what it sends; a worker loses nothing (its pushes wait in its own send queue)."""

SOCKET_BUFFER_BYTES = 8 << 20
"""Kernel send/receive buffer per connection: measured to double loopback throughput with MB frames
over the OS default (netoptim bench transport)."""

DEFAULT_MAX_PEERS = 1 << 16
"""Distinct peers (client ids) a server endpoint remembers at most, unless told otherwise."""

PEER_IDLE_S = 300.0
"""A server endpoint with as many peers as it remembers forgets the one heard from least recently,
if it was silent this long, to take a new one; otherwise the new peer is refused (LIMIT). Workers
waiting for a node ping it every few seconds, so only a peer that is gone (or computes for five
minutes without waiting on the node) is forgotten, and a laned peer forgotten gets its lanes back
with its next message."""


def default_max_frame_bytes(chunk_bytes: int, max_header_bytes: int) -> int:
    """The frame cap (ZMQ_MAXMSGSIZE) a server endpoint gets unless told otherwise: the largest frame
    the protocol sends, one payload chunk (workers cut theirs at ``DEFAULT_CHUNK_BYTES``) or one header."""
    return max(chunk_bytes, DEFAULT_CHUNK_BYTES, max_header_bytes)


def tune_socket(socket: zmq.Socket) -> None:
    socket.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a queue limit; memory is bounded by the protocol
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.SNDBUF, SOCKET_BUFFER_BYTES)
    socket.setsockopt(zmq.RCVBUF, SOCKET_BUFFER_BYTES)


class _TrackedSend(SendHandle):
    def __init__(self, trackers: list[zmq.MessageTracker]) -> None:
        self._trackers = trackers

    def done(self) -> bool:
        return all(tracker.done for tracker in self._trackers)

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for tracker in self._trackers:
            remaining = deadline - time.monotonic()
            try:
                tracker.wait(max(remaining, 0.0))
            except zmq.NotDone:
                raise TimeoutError(f"a send did not complete within {timeout_s:.1f} s") from None


def _send_frames(socket: zmq.Socket, prefix: list[bytes], header: Header, payload: Payload | None, chunk_bytes: int, *, track: bool = False) -> SendHandle:
    header_frame, *chunks = encode_message(header, payload, chunk_bytes)
    for frame in prefix:
        socket.send(frame, zmq.SNDMORE)
    if track:  # every frame, small ones too (pyzmq would copy those and call them done at once)
        frames = [header_frame, *chunks]
        return _TrackedSend(
            [
                socket.send(zmq.Frame(frame, copy=False, track=True), zmq.SNDMORE if i + 1 < len(frames) else 0, copy=False, track=True)
                for i, frame in enumerate(frames)
            ]
        )
    if not chunks:
        socket.send(header_frame)
        return _TrackedSend([])
    socket.send(header_frame, zmq.SNDMORE)
    trackers = []
    for index, chunk in enumerate(chunks):
        flags = zmq.SNDMORE if index + 1 < len(chunks) else 0
        if len(chunk) >= ZERO_COPY_BYTES:
            trackers.append(socket.send(chunk, flags, copy=False, track=True))
        else:
            socket.send(chunk, flags)
    return _TrackedSend(trackers)


_LANED = b"\x01"  # first byte of a laned client's routing ids (ZeroMQ reserves ids starting with 0)
_LANE_ID_BYTES = 8 + 2
_SINGLE = b"\x02"  # first byte of a one-lane client's routing id (8 bytes: the node takes it as it is)


def _lane_of(header: Header, lanes: int) -> int:
    return header.bucket_id % lanes if header.bucket_id >= 0 else 0


def _decode(frames: list[zmq.Frame], peer: bytes, max_message_bytes: int) -> Message:
    if not frames:
        raise WireError(ErrorCode.MALFORMED, "empty message", peer=peer)
    header = decode_header(frames[0].buffer, peer=peer)
    tensors = payload_views(header, [frame.buffer for frame in frames[1:]], max_bytes=max_message_bytes, peer=peer)
    return Message(peer=peer, header=header, tensors=tensors)


def prepare_bind_url(url: str) -> str:
    """``url`` as ZeroMQ binds it; ``ValueError`` for a TCP port outside [0, 65535], which ZeroMQ would
    silently wrap (99999 would bind 34463)."""
    _host, sep, port = url.rpartition(":")
    if url.startswith("tcp://") and sep and port.isdigit() and int(port) > 65535:
        raise ValueError(f"address {url!r}: port {int(port)} is out of range (0 to 65535; 0 lets the OS choose)")
    # ZeroMQ spells "let the OS choose" as "*"; accept the conventional port 0 too.
    return re.sub(r"^(tcp://.+):0$", r"\1:*", url)


def _ipc_in_use(path: str) -> bool:
    """Whether a process listens on the Unix socket ``path``. ZeroMQ removes whatever is at the path of
    an ``ipc://`` bind, which would take the socket from a running node without an error."""
    if path.startswith("@"):  # Linux abstract namespace: the kernel itself refuses a second bind
        return False
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"ipc://{path}: the path exists and is not a socket; refusing to replace it")
    with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False  # a stale socket file that nobody serves: ZeroMQ replaces it
        except OSError as exc:
            log.debug("cannot probe %s (%s); assuming it is in use", path, exc)
    return True


def bind_exclusive(socket: zmq.Socket, url: str) -> str:
    """Bind ``socket`` to ``url`` unless another process already serves that address, and return the
    bound endpoint. An address in use raises ``OSError`` with ``errno.EADDRINUSE``: TCP binds fail
    that way by themselves (ZeroMQ sets SO_REUSEADDR, never SO_REUSEPORT, and Linux lets only one
    listener have a port), ``ipc://`` paths are probed first. ``ValueError`` for a bad address."""
    if url.startswith("ipc://") and _ipc_in_use(url.removeprefix("ipc://")):
        raise OSError(errno.EADDRINUSE, f"{url} is in use by another process")
    try:
        socket.bind(prepare_bind_url(url))
    except zmq.ZMQError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise OSError(errno.EADDRINUSE, f"{url} is in use by another process") from None
        raise
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)


class ZmqServer(ServerEndpoint):
    """A ROUTER socket; each worker connection is one peer identity."""

    def __init__(
        self,
        context: zmq.Context,
        url: str,
        *,
        max_message_bytes: int,
        chunk_bytes: int,
        curve: CurveServerConfig | None = None,
        max_frame_bytes: int | None = None,
        max_header_bytes: int = MAX_HEADER_BYTES,
        max_peers: int = DEFAULT_MAX_PEERS,
    ) -> None:
        if max_peers < 1 or max_header_bytes < 1:
            raise ValueError(f"max_peers and max_header_bytes must be positive, got {max_peers} and {max_header_bytes}")
        self.max_frame_bytes = default_max_frame_bytes(chunk_bytes, max_header_bytes) if max_frame_bytes is None else max_frame_bytes
        self._socket = context.socket(zmq.ROUTER)
        if curve is not None:
            secure_server_socket(self._socket, curve)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished peer raises, not vanishes
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a worker's socket reconnected after a reset keeps its id
        tune_socket(self._socket)
        self._socket.setsockopt(zmq.RCVHWM, NODE_RCVHWM)
        self._socket.setsockopt(zmq.LINGER, 0)
        # libzmq drops the connection of a peer that sends a larger frame, before it allocates the frame.
        # It bounds each frame only: see docs/operations.md (Limits) for multipart messages.
        self._socket.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        try:
            self.address = bind_exclusive(self._socket, url)
        except Exception:
            self._socket.close(linger=0)
            raise
        self._chunk_bytes = chunk_bytes
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._same_host_path: Path | None = None
        self._lanes: dict[bytes, int] = {}  # laned client id -> its lane count (only peers in _peers)
        self._peers: OrderedDict[bytes, float] = OrderedDict()  # every peer heard -> when, least recent first
        self._max_peers = max_peers
        self._max_header_bytes = max_header_bytes
        self._max_payload = max_message_bytes
        self._payload_limit = max_message_bytes
        self._payload_why = f"this node's limit of {max_message_bytes} bytes (--max-message-bytes)"
        self._authenticated = curve is not None  # CURVE: the ZAP handler tags each message with the sender's key

    def recv(self, timeout_s: float) -> Message | None:
        if not self._poller.poll(int(timeout_s * 1000)):
            return None
        frames = self._socket.recv_multipart(copy=False)
        peer = self._admit(frames[0].bytes)
        message = self._decode(frames[1:], peer)
        if self._authenticated:
            # The routing id is the client's to choose; the User-Id is the public key its CURVE
            # handshake proved, set by the ZAP handler on every message of that connection.
            message.user_id = frames[-1].get("User-Id")
        return message

    def limit_payload(self, max_bytes: int, why: str) -> None:
        """From now on refuse payloads over ``max_bytes`` (and over max_message_bytes), before they are viewed."""
        if max_bytes < self._payload_limit:
            self._payload_limit, self._payload_why = max_bytes, why

    def unlimit_payload(self) -> None:
        self._payload_limit = self._max_payload
        self._payload_why = f"this node's limit of {self._max_payload} bytes (--max-message-bytes)"

    def _admit(self, routing_id: bytes) -> bytes:
        """The peer ``routing_id`` belongs to (a laned client's lanes are one peer), remembered as
        heard now; ``WireError(LIMIT)`` for a new peer when ``max_peers`` are remembered and none of
        them has been silent for ``PEER_IDLE_S`` (answered on ``routing_id`` itself, which the
        ROUTER can route without any bookkeeping)."""
        peer, lanes = routing_id, 0
        if len(routing_id) == _LANE_ID_BYTES and routing_id[:1] == _LANED:  # one lane of a laned client: the client is the peer
            peer, lanes = routing_id[:8], routing_id[9]
        now = time.monotonic()
        if peer in self._peers:
            self._peers.move_to_end(peer)
        elif len(self._peers) >= self._max_peers and not self._forget_idle_peer(now):
            raise WireError(
                ErrorCode.LIMIT,
                f"this node talks to {len(self._peers)} peers already, the most it keeps track of, and all were heard from in the last "
                f"{PEER_IDLE_S:.0f} s; start the node with a higher --max-peers to allow more",
                peer=routing_id,
            )
        self._peers[peer] = now
        if lanes:
            self._lanes[peer] = lanes
        return peer

    def _forget_idle_peer(self, now: float) -> bool:
        oldest, heard = next(iter(self._peers.items()))
        if now - heard < PEER_IDLE_S:
            return False
        del self._peers[oldest]
        self._lanes.pop(oldest, None)
        return True

    def _decode(self, frames: list[zmq.Frame], peer: bytes) -> Message:
        """A received message, with this endpoint's limits checked before the payload is viewed."""
        if not frames:
            raise WireError(ErrorCode.MALFORMED, "empty message", peer=peer)
        if len(frames[0]) > self._max_header_bytes:
            raise WireError(
                ErrorCode.TOO_LARGE, f"header of {len(frames[0])} bytes is over this node's limit of {self._max_header_bytes} (--max-header-bytes)", peer=peer
            )
        header = decode_header(frames[0].buffer, peer=peer)
        if header.payload_bytes > self._payload_limit:
            raise WireError(ErrorCode.TOO_LARGE, f"payload of {header.payload_bytes} bytes is over {self._payload_why}", peer=peer)
        tensors = payload_views(header, [frame.buffer for frame in frames[1:]], max_bytes=self._payload_limit, peer=peer)
        return Message(peer=peer, header=header, tensors=tensors)

    def send(self, peer: bytes, header: Header, payload: Payload | None = None, *, track: bool = False) -> SendHandle:
        lanes = self._lanes.get(peer)
        route = peer if lanes is None else peer + struct.pack("BB", _lane_of(header, lanes), lanes)
        try:
            return _send_frames(self._socket, [route], header, payload, self._chunk_bytes, track=track)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise ConnectionError(f"peer {peer.hex()} is gone") from exc
            raise

    def bind_same_host(self) -> str | None:
        """An ipc:// endpoint (a Unix socket) beside a tcp:// one, under the temporary directory with a
        random name: only a process on this host can reach it, and no two nodes share one."""
        if not self.address.startswith("tcp://"):
            return None
        path = Path(tempfile.gettempdir()) / f"netoptim-{secrets.token_hex(8)}.sock"
        bind_exclusive(self._socket, f"ipc://{path}")
        self._same_host_path = path
        return f"ipc://{path}"

    def close(self) -> None:
        self._socket.close(linger=0)
        if self._same_host_path is not None:
            self._same_host_path.unlink(missing_ok=True)
            self._same_host_path = None


class ZmqClient(ClientEndpoint):
    """DEALER sockets connected to one node: one, or ``lanes`` (see the module docstring)."""

    def __init__(
        self, context: zmq.Context, url: str, *, max_message_bytes: int, chunk_bytes: int, curve: CurveClientConfig | None = None, lanes: int = 1
    ) -> None:
        if not 1 <= lanes <= 255:
            raise ValueError(f"connections per node must be in [1, 255], not {lanes}")
        client_id = secrets.token_bytes(7)
        self.sockets: list[zmq.Socket] = []
        for lane in range(lanes):
            socket = context.socket(zmq.DEALER)
            if curve is not None:
                secure_client_socket(socket, curve)
            tune_socket(socket)
            socket.setsockopt(zmq.LINGER, 1000)
            # A routing id of its own, kept when ZeroMQ reconnects the socket after a reset: the node
            # (ROUTER_HANDOVER) then still knows who sends, while the worker resyncs what was lost.
            routing_id = _SINGLE + client_id if lanes == 1 else _LANED + client_id + struct.pack("BB", lane, lanes)
            socket.setsockopt(zmq.ROUTING_ID, routing_id)
            socket.connect(url)
            self.sockets.append(socket)
        # Disconnections (a reset link, a node gone): ZeroMQ reconnects by itself and drops what was
        # in flight, which only the worker can make good.
        self._monitors = [socket.get_monitor_socket(zmq.EVENT_DISCONNECTED) for socket in self.sockets]
        self.address = url
        self.lanes = lanes
        self._max_message_bytes = max_message_bytes
        self._chunk_bytes = chunk_bytes
        self._poller = zmq.Poller()
        for socket in self.sockets:
            self._poller.register(socket, zmq.POLLIN)

    @property
    def socket(self) -> zmq.Socket:
        """Lane 0 (the only one unless lanes were asked for)."""
        return self.sockets[0]

    def send(self, header: Header, payload: Payload | None = None) -> SendHandle:
        return _send_frames(self.sockets[_lane_of(header, self.lanes)], [], header, payload, self._chunk_bytes)

    def send_raw(self, frames: Sequence[bytes]) -> None:
        """Send arbitrary frames; only for tests of how a node treats bad input."""
        self.sockets[0].send_multipart(list(frames))

    def recv(self, timeout_s: float) -> Message | None:
        ready = self._poller.poll(int(timeout_s * 1000))
        if not ready:
            return None
        return _decode(ready[0][0].recv_multipart(copy=False), b"", self._max_message_bytes)

    def connection_dropped(self) -> bool:
        dropped = False
        for monitor in self._monitors:
            while monitor.poll(0):
                monitor.recv_multipart()
                dropped = True
        return dropped

    def close(self) -> None:
        for socket, monitor in zip(self.sockets, self._monitors, strict=True):
            if not socket.closed:
                socket.disable_monitor()
            monitor.close()
            socket.close()


class ZmqTransport(Transport):
    """Owns one ZeroMQ context; endpoints it creates must be closed before it."""

    def __init__(
        self,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        io_threads: int = 1,
        curve_server: CurveServerConfig | None = None,
        curve_client: CurveClientConfig | None = None,
        connections_per_peer: int = 1,
        max_frame_bytes: int | None = None,
        max_header_bytes: int = MAX_HEADER_BYTES,
        max_peers: int = DEFAULT_MAX_PEERS,
    ) -> None:
        """``max_frame_bytes`` (``None``: :func:`default_max_frame_bytes`), ``max_header_bytes`` and
        ``max_peers`` are the limits of the server endpoints it binds (see :class:`ZmqServer`)."""
        if not 1 <= connections_per_peer <= 255:
            raise ValueError(f"connections per node must be in [1, 255], not {connections_per_peer}")
        self._lanes = connections_per_peer
        for config in (curve_server, curve_client):
            if config is not None:
                config.validate()
        self._context = zmq.Context(io_threads=max(io_threads, connections_per_peer))  # lanes move in parallel
        self._max_message_bytes = max_message_bytes
        self._chunk_bytes = chunk_bytes
        self._server_limits = {"max_frame_bytes": max_frame_bytes, "max_header_bytes": max_header_bytes, "max_peers": max_peers}
        self._curve_server = curve_server
        self._curve_client = curve_client
        self._authenticator: ThreadAuthenticator | None = None
        self._pollers: dict[tuple[zmq.Socket, ...], zmq.Poller] = {}

    def bind(self, url: str) -> ZmqServer:
        if self._curve_server is not None and self._authenticator is None:
            # ZAP handler: only clients whose public key is in the allow-list complete the handshake.
            self._authenticator = ThreadAuthenticator(self._context, log=logging.getLogger("netoptim.curve"))
            self._authenticator.start()
            self._authenticator.configure_curve(domain="*", location=self._curve_server.allowed_keys_dir)
        return ZmqServer(
            self._context, url, max_message_bytes=self._max_message_bytes, chunk_bytes=self._chunk_bytes, curve=self._curve_server, **self._server_limits
        )

    def connect(self, url: str) -> ZmqClient:
        return ZmqClient(
            self._context, url, max_message_bytes=self._max_message_bytes, chunk_bytes=self._chunk_bytes, curve=self._curve_client, lanes=self._lanes
        )

    def wait_readable(self, clients: Sequence[ClientEndpoint], timeout_s: float) -> list[int]:
        key = tuple(socket for client in clients for socket in client.sockets)  # type: ignore[attr-defined]
        poller = self._pollers.get(key)
        if poller is None:  # a worker polls the same connections every step: build the poller once
            poller = zmq.Poller()
            for client in clients:
                assert isinstance(client, ZmqClient)
                for socket in client.sockets:
                    poller.register(socket, zmq.POLLIN)
            self._pollers = {key: poller}
        ready = dict(poller.poll(int(timeout_s * 1000)))
        return [index for index, client in enumerate(clients) if any(ready.get(socket) for socket in client.sockets)]  # type: ignore[attr-defined]

    def close(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        self._context.term()
