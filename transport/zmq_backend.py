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

import msgpack
import zmq
from zmq.auth.thread import ThreadAuthenticator

from transport.interface import ClientEndpoint, Message, SendHandle, ServerEndpoint, Transport
from transport.same_host_shm import CREDIT, DEFAULT_WINDOW_BYTES, HANDSHAKE, SHARED, SharedClient, SharedConnection, SharedPeers, is_control
from transport.security import CurveClientConfig, CurveServerConfig, secure_client_socket, secure_server_socket
from transport.shm_window import parse_credits
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


def _send_frames(
    socket: zmq.Socket,
    prefix: list[bytes],
    header: Header,
    payload: Payload | None,
    chunk_bytes: int,
    *,
    track: bool = False,
    shared: SharedConnection | None = None,
) -> SendHandle:
    if shared is not None:  # the payload into the peer's window, when there is room: only control frames go
        frames = shared.frames(header, payload, chunk_bytes)
        if frames is not None:
            return _send_small(socket, [*prefix, *frames], track)
    header_frame, *chunks = encode_message(header, payload, chunk_bytes)
    if track:  # every frame, small ones too (pyzmq would copy those and call them done at once)
        return _send_small(socket, [*prefix, header_frame, *chunks], True)
    for frame in prefix:
        socket.send(frame, zmq.SNDMORE)
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


def _send_small(socket: zmq.Socket, frames: list, track: bool) -> SendHandle:
    """Send ``frames``; with ``track``, a handle done once every one of them has left the process."""
    if not track:
        socket.send_multipart(frames)
        return _TrackedSend([])
    trackers = []
    for index, frame in enumerate(frames):
        flags = zmq.SNDMORE if index + 1 < len(frames) else 0
        trackers.append(socket.send(zmq.Frame(frame, copy=False, track=True), flags, copy=False, track=True))
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
        same_host_window_bytes: int = DEFAULT_WINDOW_BYTES,
    ) -> None:
        if max_peers < 1 or max_header_bytes < 1:
            raise ValueError(f"max_peers and max_header_bytes must be positive, got {max_peers} and {max_header_bytes}")
        self.max_frame_bytes = default_max_frame_bytes(chunk_bytes, max_header_bytes) if max_frame_bytes is None else max_frame_bytes
        self._context = context
        self._curve = curve
        self._socket = self._router_socket()
        try:
            self.address = bind_exclusive(self._socket, url)
        except Exception:
            self._socket.close(linger=0)
            raise
        self._chunk_bytes = chunk_bytes
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._same_host_path: Path | None = None
        # The same-host socket, once bound (the only one of a node that listens on ipc:// alone).
        self._ipc_socket: zmq.Socket | None = self._socket if self.address.startswith("ipc://") else None
        self._ipc_peers: set[bytes] = set()  # peers heard on it (answered there)
        # Payloads in shared memory for same-host peers that ask (not with CURVE: its keys vouch
        # for the socket, which is what a node's identity checks rely on).
        self._shared = (
            SharedPeers(lambda fd: self._poller.register(fd, zmq.POLLIN), self._poller.unregister, same_host_window_bytes)
            if curve is None and same_host_window_bytes > 0
            else None
        )
        self._turn = 0  # which socket is read first when both have messages
        self._lanes: dict[bytes, int] = {}  # laned client id -> its lane count (only peers in _peers)
        self._peers: OrderedDict[bytes, float] = OrderedDict()  # every peer heard -> when, least recent first
        self._max_peers = max_peers
        self._max_header_bytes = max_header_bytes
        self._max_payload = max_message_bytes
        self._payload_limit = max_message_bytes
        self._payload_why = f"this node's limit of {max_message_bytes} bytes (--max-message-bytes)"
        self._authenticated = curve is not None  # CURVE: the ZAP handler tags each message with the sender's key

    def _router_socket(self) -> zmq.Socket:
        socket = self._context.socket(zmq.ROUTER)
        if self._curve is not None:
            secure_server_socket(socket, self._curve)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished peer raises, not vanishes
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a worker's socket reconnected after a reset keeps its id
        tune_socket(socket)
        socket.setsockopt(zmq.RCVHWM, NODE_RCVHWM)
        socket.setsockopt(zmq.LINGER, 0)
        # libzmq drops the connection of a peer that sends a larger frame, before it allocates the frame.
        # It bounds each frame only: see docs/operations.md (Limits) for multipart messages.
        socket.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        return socket

    def recv(self, timeout_s: float) -> Message | None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._send_credits()
            events = dict(self._poller.poll(max(int((deadline - time.monotonic()) * 1000), 0)))
            if not events:
                if time.monotonic() >= deadline:
                    return None
                continue
            sockets = [socket for socket in {self._socket: 0, self._ipc_socket: 0} if socket is not None and events.get(socket)]
            if not sockets:  # only a same-host worker's process exit
                self._reap(events)
                continue
            self._turn += 1
            socket = sockets[self._turn % len(sockets)]
            frames = socket.recv_multipart(copy=False)
            message = self._take(socket, frames)
            if message is not None:
                return message

    def _take(self, socket: zmq.Socket, frames: list[zmq.Frame]) -> Message | None:
        """One frame set read from ``socket``: the message, or ``None`` for a shared-memory control frame."""
        routing_id = frames[0].bytes
        peer = self._admit(routing_id)
        shared = socket is self._ipc_socket and len(frames) > 1 and is_control(frames[1].buffer)
        if socket is self._ipc_socket:
            self._ipc_peers.add(peer)
        if shared:
            message = self._take_shared(peer, frames[1:])
        else:
            message = self._decode(frames[1:], peer)
        if message is not None and self._authenticated:
            # The routing id is the client's to choose; the User-Id is the public key its CURVE
            # handshake proved, set by the ZAP handler on every message of that connection.
            message.user_id = frames[-1].get("User-Id")
        return message

    def _take_shared(self, peer: bytes, frames: list[zmq.Frame]) -> Message | None:
        assert self._ipc_socket is not None
        kind = frames[0].bytes
        if self._shared is None:  # shared memory is off here: say so, and the worker stays on the socket
            if kind == HANDSHAKE:
                why = "this node uses CURVE: payloads stay on its socket" if self._curve is not None else "this node keeps payloads on its socket"
                self._ipc_socket.send_multipart([peer, HANDSHAKE, msgpack.packb({"refused": why})])
                return None
            raise WireError(ErrorCode.BAD_REQUEST, "a shared-memory frame to a node that gave no windows", peer=peer)
        if kind == SHARED and len(frames) == 3:
            connection = self._shared.connections.get(peer)
            if connection is None:
                raise WireError(ErrorCode.BAD_REQUEST, "a shared-memory message from a connection without windows: reconnect", peer=peer)
            return self._decode(frames[1:2], peer, shared=(connection, frames[2].buffer))
        if kind == CREDIT and len(frames) == 2:
            connection = self._shared.connections.get(peer)
            if connection is not None:
                connection.writer.credit(parse_credits(frames[1].buffer, peer))
            return None
        if kind == HANDSHAKE and len(frames) == 2:
            answer = self._shared.handshake(peer, frames[1].buffer)
            if answer is not None:
                self._ipc_socket.send_multipart([peer, HANDSHAKE, answer])
            return None
        raise WireError(ErrorCode.MALFORMED, f"not a shared-memory frame set ({kind!r}, {len(frames)} frames)", peer=peer)

    def _reap(self, events: dict) -> None:
        """Forget the windows of same-host workers whose process exited."""
        assert self._shared is not None
        for pidfd, event in events.items():
            if isinstance(pidfd, int) and event:
                self._shared.exited(pidfd)

    def _send_credits(self) -> None:
        if self._shared is None or self._ipc_socket is None:
            return
        for peer, body in self._shared.credits():
            try:
                self._ipc_socket.send_multipart([peer, CREDIT, body])
            except zmq.ZMQError:  # the peer is gone: so are its windows
                self._shared.forget(peer)

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
        self._ipc_peers.discard(oldest)
        if self._shared is not None:
            self._shared.forget(oldest)
        return True

    def _decode(self, frames: list[zmq.Frame], peer: bytes, shared: tuple[SharedConnection, memoryview] | None = None) -> Message:
        """A received message, with this endpoint's limits checked before the payload is viewed;
        ``shared``: its payload is in that connection's window, where the extent says."""
        if not frames:
            raise WireError(ErrorCode.MALFORMED, "empty message", peer=peer)
        if len(frames[0]) > self._max_header_bytes:
            raise WireError(
                ErrorCode.TOO_LARGE, f"header of {len(frames[0])} bytes is over this node's limit of {self._max_header_bytes} (--max-header-bytes)", peer=peer
            )
        header = decode_header(frames[0].buffer, peer=peer)
        if header.payload_bytes > self._payload_limit:
            raise WireError(ErrorCode.TOO_LARGE, f"payload of {header.payload_bytes} bytes is over {self._payload_why}", peer=peer)
        chunks = [frame.buffer for frame in frames[1:]] if shared is None else shared[0].read(header, shared[1], peer)
        tensors = payload_views(header, chunks, max_bytes=self._payload_limit, peer=peer)
        return Message(peer=peer, header=header, tensors=tensors)

    def send(self, peer: bytes, header: Header, payload: Payload | None = None, *, track: bool = False) -> SendHandle:
        lanes = self._lanes.get(peer)
        route = peer if lanes is None else peer + struct.pack("BB", _lane_of(header, lanes), lanes)
        on_ipc = peer in self._ipc_peers
        socket = self._ipc_socket if on_ipc and self._ipc_socket is not None else self._socket
        shared = self._shared.connections.get(peer) if on_ipc and self._shared is not None else None
        try:
            handle = _send_frames(socket, [route], header, payload, self._chunk_bytes, track=track, shared=shared)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise ConnectionError(f"peer {peer.hex()} is gone") from exc
            raise
        self._send_credits()
        return handle

    def bind_same_host(self) -> str | None:
        """An ipc:// endpoint (a Unix socket) beside a tcp:// one, under the temporary directory with a
        random name: only a process on this host can reach it, and no two nodes share one. It is a
        socket of its own, so that only peers on it are offered shared memory."""
        if not self.address.startswith("tcp://") or self._ipc_socket is not None:
            return None
        path = Path(tempfile.gettempdir()) / f"netoptim-{secrets.token_hex(8)}.sock"
        socket = self._router_socket()
        try:
            bind_exclusive(socket, f"ipc://{path}")
        except Exception:
            socket.close(linger=0)
            raise
        self._ipc_socket = socket
        self._poller.register(socket, zmq.POLLIN)
        self._same_host_path = path
        return f"ipc://{path}"

    @property
    def shared_written_bytes(self) -> int:
        """Payload bytes this endpoint wrote into same-host peers' windows (not sent on a socket)."""
        return 0 if self._shared is None else self._shared.written_bytes

    def close(self) -> None:
        self._socket.close(linger=0)
        if self._ipc_socket is not None and self._ipc_socket is not self._socket:
            self._ipc_socket.close(linger=0)
        if self._shared is not None:
            self._shared.close()
        if self._same_host_path is not None:
            self._same_host_path.unlink(missing_ok=True)
            self._same_host_path = None


class ZmqClient(ClientEndpoint):
    """DEALER sockets connected to one node: one, or ``lanes`` (see the module docstring)."""

    def __init__(
        self,
        context: zmq.Context,
        url: str,
        *,
        max_message_bytes: int,
        chunk_bytes: int,
        curve: CurveClientConfig | None = None,
        lanes: int = 1,
        shared_memory: bool = True,
    ) -> None:
        """``shared_memory``: over an ``ipc://`` address with one lane and no CURVE, ask the node for
        shared windows (:mod:`transport.same_host_shm`); payloads go on the socket until they are mapped."""
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
        self.shared: SharedClient | None = None
        if shared_memory and url.startswith("ipc://") and lanes == 1 and curve is None:
            self.shared = SharedClient()
            self.sockets[0].send_multipart(SharedClient.request())

    @property
    def socket(self) -> zmq.Socket:
        """Lane 0 (the only one unless lanes were asked for)."""
        return self.sockets[0]

    def send(self, header: Header, payload: Payload | None = None) -> SendHandle:
        shared = self.shared.connection if self.shared is not None else None
        handle = _send_frames(self.sockets[_lane_of(header, self.lanes)], [], header, payload, self._chunk_bytes, shared=shared)
        self._send_credits()
        return handle

    def send_raw(self, frames: Sequence[bytes]) -> None:
        """Send arbitrary frames; only for tests of how a node treats bad input."""
        self.sockets[0].send_multipart(list(frames))

    def recv(self, timeout_s: float) -> Message | None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._send_credits()
            ready = self._poller.poll(max(int((deadline - time.monotonic()) * 1000), 0))
            if ready:
                message = self._take(ready[0][0].recv_multipart(copy=False))
                if message is not None:
                    return message
            elif time.monotonic() >= deadline:
                return None

    def _take(self, frames: list[zmq.Frame]) -> Message | None:
        """A frame set from the node: its message, or ``None`` for a shared-memory control frame."""
        if self.shared is None or not frames or not is_control(frames[0].buffer):
            return _decode(frames, b"", self._max_message_bytes)
        kind = frames[0].bytes
        if kind == SHARED and len(frames) == 3 and self.shared.connection is not None:
            header = decode_header(frames[1].buffer)
            chunks = self.shared.connection.read(header, frames[2].buffer, None)
            return Message(peer=b"", header=header, tensors=payload_views(header, chunks, max_bytes=self._max_message_bytes))
        if kind == CREDIT and len(frames) == 2:
            self.shared.credit(frames[1].buffer)
        elif kind == HANDSHAKE and len(frames) == 2:
            reply = self.shared.answer(frames[1].buffer)
            if reply is not None:
                self.sockets[0].send_multipart(reply)
        else:
            raise WireError(ErrorCode.MALFORMED, f"not a shared-memory frame set from the node ({kind!r}, {len(frames)} frames)")
        return None

    def _send_credits(self) -> None:
        if self.shared is not None and self.shared.connection is not None:
            body = self.shared.connection.reader.take_credits()
            if body is not None:
                self.sockets[0].send_multipart([CREDIT, body])

    def connection_dropped(self) -> bool:
        dropped = False
        for monitor in self._monitors:
            while monitor.poll(0):
                monitor.recv_multipart()
                dropped = True
        return dropped

    def close(self) -> None:
        if self.shared is not None:
            if self.shared.connection is not None and not self.sockets[0].closed:  # the node frees the windows now
                self.sockets[0].send_multipart([HANDSHAKE, msgpack.packb({"closed": True})])
            self.shared.close()
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
        same_host_window_bytes: int = DEFAULT_WINDOW_BYTES,
        shared_memory: bool = True,
    ) -> None:
        """``max_frame_bytes`` (``None``: :func:`default_max_frame_bytes`), ``max_header_bytes`` and
        ``max_peers`` are the limits of the server endpoints it binds (see :class:`ZmqServer`);
        ``same_host_window_bytes`` the shared window a server gives each same-host connection, each
        way (0: none); ``shared_memory`` whether clients ask for one."""
        if not 1 <= connections_per_peer <= 255:
            raise ValueError(f"connections per node must be in [1, 255], not {connections_per_peer}")
        self._lanes = connections_per_peer
        for config in (curve_server, curve_client):
            if config is not None:
                config.validate()
        self._context = zmq.Context(io_threads=max(io_threads, connections_per_peer))  # lanes move in parallel
        self._max_message_bytes = max_message_bytes
        self._chunk_bytes = chunk_bytes
        self._server_limits = {
            "max_frame_bytes": max_frame_bytes,
            "max_header_bytes": max_header_bytes,
            "max_peers": max_peers,
            "same_host_window_bytes": same_host_window_bytes,
        }
        self._shared_memory = shared_memory
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
            self._context,
            url,
            max_message_bytes=self._max_message_bytes,
            chunk_bytes=self._chunk_bytes,
            curve=self._curve_client,
            lanes=self._lanes,
            shared_memory=self._shared_memory,
        )

    def wait_readable(self, clients: Sequence[ClientEndpoint], timeout_s: float) -> list[int]:
        for client in clients:  # extents of same-host windows given back: the node may reuse them
            client._send_credits()  # type: ignore[attr-defined]
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
