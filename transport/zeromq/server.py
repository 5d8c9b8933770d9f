"""The node's ZeroMQ endpoint: a ROUTER socket, and a second one on the same-host ``ipc://`` socket
whose peers may move their payloads through shared windows (:mod:`transport.shm.same_host`)."""

from __future__ import annotations

import secrets
import struct
import tempfile
import time
from collections import OrderedDict
from collections.abc import Hashable
from pathlib import Path

import msgpack
import torch
import zmq

from transport.interface import Message, SendHandle, ServerEndpoint
from transport.payload_views import payload_views
from transport.shm.same_host import CREDIT, DEFAULT_WINDOW_BYTES, HANDSHAKE, SHARED, SharedConnection, SharedPeers, is_control
from transport.shm.window import parse_credits
from transport.wire import MAX_HEADER_BYTES, ErrorCode, Header, Payload, WireError, decode_header
from transport.zeromq.security import CurveServerConfig, secure_server_socket
from transport.zeromq.sockets import (
    DEFAULT_MAX_PEERS,
    LANE_ID_BYTES,
    LANED,
    NODE_RCVHWM,
    PEER_IDLE_S,
    bind_exclusive,
    default_max_frame_bytes,
    lane_of,
    send_frames,
    tune_socket,
)


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
        self._listening: tuple[zmq.Socket, ...] = (self._socket,)
        self._ipc_peers: set[bytes] = set()  # peers heard on it (answered there)
        # Payloads in shared memory for same-host peers that ask (not with CURVE: its keys vouch
        # for the socket, which is what a node's identity checks rely on).
        self._shared = (
            SharedPeers(lambda fd: self._poller.register(fd, zmq.POLLIN), self._poller.unregister, same_host_window_bytes)
            if curve is None and same_host_window_bytes > 0
            else None
        )
        self._wake_fd: int | None = None  # readable: recv returns None (wake_on)
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
            if self._wake_fd is not None and events.pop(self._wake_fd, 0):
                return None  # the caller's other thread has news: its messages wait for the next call
            sockets = [socket for socket in self._listening if events.get(socket)]
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
                self._send_control(peer, [HANDSHAKE, msgpack.packb({"refused": why})])
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
                self._send_control(peer, [HANDSHAKE, answer])
            return None
        raise WireError(ErrorCode.MALFORMED, f"not a shared-memory frame set ({kind!r}, {len(frames)} frames)", peer=peer)

    def wake_on(self, fd: int) -> bool:
        assert self._wake_fd is None, "one wake-up descriptor"
        self._poller.register(fd, zmq.POLLIN)
        self._wake_fd = fd
        return True

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
            self._send_control(peer, [CREDIT, body])

    def _send_control(self, peer: bytes, frames: list[bytes]) -> None:
        """A frame set of the shared-memory path to ``peer``; a peer already gone (it may close right
        after its last frame) takes its windows with it, and the node goes on."""
        assert self._ipc_socket is not None
        try:
            self._ipc_socket.send_multipart([peer, *frames])
        except zmq.ZMQError:
            if self._shared is not None:
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
        if len(routing_id) == LANE_ID_BYTES and routing_id[:1] == LANED:  # one lane of a laned client: the client is the peer
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
        return self._send(peer, header, payload, track, None)

    def send_published(self, peer: bytes, header: Header, payload: Payload, key: Hashable, version: Hashable) -> SendHandle:
        return self._send(peer, header, payload, False, (key, version))

    def publish_board(self, nbytes: int, *, slots_per_key: int = 1) -> bool:
        """A board for the same-host peers with windows (none with CURVE or windows off), offered to
        those connected now and to every later one once its windows are mapped."""
        if self._shared is None or self._ipc_socket is None:
            return False
        for peer, offer in self._shared.publish_board(nbytes, f"netoptim-board-{secrets.token_hex(8)}", slots_per_key=slots_per_key):
            self._send_control(peer, [HANDSHAKE, offer])
        return self._shared.board is not None

    def size_inboxes(self, nbytes: int) -> None:
        """Same-host connections made from now on get a window of ``nbytes`` for what they send here
        (:meth:`SharedPeers.size_inboxes`)."""
        if self._shared is not None:
            self._shared.size_inboxes(nbytes)

    def drop_board(self) -> None:
        if self._shared is not None:
            self._shared.drop_board()

    def board_slot(self, key: Hashable, nbytes: int) -> torch.Tensor | None:
        return self._shared.board_slot(key, nbytes) if self._shared is not None else None

    def board_written(self, key: Hashable, version: Hashable) -> None:
        if self._shared is not None:
            self._shared.board_written(key, version)

    def board_held(self, key: Hashable, version: Hashable) -> torch.Tensor | None:
        board = self._shared.board if self._shared is not None else None
        return board.held(key, version) if board is not None else None

    def _send(self, peer: bytes, header: Header, payload: Payload | None, track: bool, published: tuple[Hashable, Hashable] | None) -> SendHandle:
        lanes = self._lanes.get(peer)
        route = peer if lanes is None else peer + struct.pack("BB", lane_of(header, lanes), lanes)
        on_ipc = peer in self._ipc_peers
        socket = self._ipc_socket if on_ipc and self._ipc_socket is not None else self._socket
        shared = self._shared.connections.get(peer) if on_ipc and self._shared is not None else None
        try:
            handle = send_frames(socket, [route], header, payload, self._chunk_bytes, track=track, shared=shared, published=published)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise ConnectionError(f"peer {peer.hex()} is gone") from exc
            raise
        return handle  # credits due go out with the next recv: the node's loop calls it all the time

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
        self._listening = (self._socket, socket)
        self._poller.register(socket, zmq.POLLIN)
        self._same_host_path = path
        return f"ipc://{path}"

    @property
    def shared_written_bytes(self) -> int:
        """Payload bytes this endpoint wrote into same-host peers' windows (not sent on a socket)."""
        return self.shared_memory()["written_bytes"]

    def shared_memory(self) -> dict[str, int]:
        """Same-host connections with shared windows and the payload bytes through them each way
        (written: to workers, read: from them); safe to call from another thread."""
        return super().shared_memory() if self._shared is None else self._shared.snapshot()

    def close(self) -> None:
        if self._wake_fd is not None:
            self._poller.unregister(self._wake_fd)
            self._wake_fd = None
        self._socket.close(linger=0)
        if self._ipc_socket is not None and self._ipc_socket is not self._socket:
            self._ipc_socket.close(linger=0)
        if self._shared is not None:
            self._shared.close()
        if self._same_host_path is not None:
            self._same_host_path.unlink(missing_ok=True)
            self._same_host_path = None
