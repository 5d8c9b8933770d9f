"""ZeroMQ backend: ROUTER on the node, one DEALER per worker-to-node connection, ``tcp://`` or ``ipc://``.

Frames at or above ``ZERO_COPY_BYTES`` are sent without a copy and tracked one by one (pyzmq tracks
only the last frame of a multipart send), so callers can know when a buffer may be reused.

A client may open several connections (*lanes*) to one node, for links one TCP stream cannot fill.
Each lane is a DEALER socket whose routing id is the client's id plus its lane number and the lane
count, so the node's ROUTER sees one peer. A message about bucket ``b`` takes lane ``b % lanes`` in
both directions and every other message lane 0: messages about one bucket keep their order, as do
all messages about none; messages about different buckets may pass each other.

The node's endpoint is :mod:`transport.zeromq.server`, what both ends share :mod:`transport.zeromq.sockets`.
"""

from __future__ import annotations

import logging
import secrets
import struct
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet

import msgpack
import torch
import zmq
from zmq.auth.thread import ThreadAuthenticator

from transport.interface import ClientEndpoint, Message, SendHandle, Transport
from transport.payload_views import board_payload_views, payload_views
from transport.shm.same_host import BOARD, CREDIT, DEFAULT_WINDOW_BYTES, HANDSHAKE, SHARED, SharedClient, is_control
from transport.wire import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_MESSAGE_BYTES, MAX_HEADER_BYTES, ErrorCode, Header, Payload, WireError, decode_header
from transport.zeromq.link_watch import WATCHED_EVENTS, LinkWatch
from transport.zeromq.security import AllowedKeys, AllowList, CurveClientConfig, CurveServerConfig, secure_client_socket
from transport.zeromq.server import ZmqServer
from transport.zeromq.sockets import (
    DEFAULT_MAX_PEERS,
    LANED,
    SINGLE,
    bind_exclusive,
    decode_message,
    default_max_frame_bytes,
    lane_of,
    prepare_bind_url,
    send_frames,
    tune_socket,
)

__all__ = ["ZmqClient", "ZmqServer", "ZmqTransport", "bind_exclusive", "default_max_frame_bytes", "prepare_bind_url", "tune_socket"]


def _monitor_of(socket: zmq.Socket, context: zmq.Context) -> zmq.Socket:
    """A socket that receives ``socket``'s :data:`WATCHED_EVENTS`, with no high-water mark: ZeroMQ's
    I/O thread blocks on a full monitor queue (measured: after 2,000 undrained events, every socket
    of the context stopped moving), and a node that refuses connections for minutes makes ten events
    a second (~100 bytes each), drained whenever the worker asks after the link."""
    address = f"inproc://netoptim-link-{secrets.token_hex(8)}"
    socket.monitor(address, WATCHED_EVENTS)
    monitor = context.socket(zmq.PAIR)
    monitor.setsockopt(zmq.RCVHWM, 0)  # before connecting: an inproc pipe takes its limit then
    monitor.connect(address)
    return monitor


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
        shared windows (:mod:`transport.shm.same_host`); payloads go on the socket until they are mapped."""
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
            routing_id = SINGLE + client_id if lanes == 1 else LANED + client_id + struct.pack("BB", lane, lanes)
            socket.setsockopt(zmq.ROUTING_ID, routing_id)
            socket.connect(url)
            self.sockets.append(socket)
        # Disconnections (a reset link, a node gone): ZeroMQ reconnects by itself and drops what was
        # in flight, which only the worker can make good. The attempts and handshakes say why a node
        # that does not answer does not (see transport.zeromq.link_watch).
        self._monitors = [_monitor_of(socket, context) for socket in self.sockets]
        self._links = [LinkWatch(curve=curve is not None) for _ in self.sockets]
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
        handle = send_frames(self.sockets[lane_of(header, self.lanes)], [], header, payload, self._chunk_bytes, shared=shared)
        self._send_credits()
        return handle

    def reserve(self, nbytes: int) -> torch.Tensor | None:
        return self.shared.reserve(nbytes) if self.shared is not None else None

    def cancel(self, reserved: torch.Tensor) -> None:
        if self.shared is not None:
            self.shared.cancel(reserved)

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
            return decode_message(frames, b"", self._max_message_bytes)
        kind = frames[0].bytes
        if kind == SHARED and len(frames) == 3 and self.shared.connection is not None:
            header = decode_header(frames[1].buffer)
            chunks = self.shared.connection.read(header, frames[2].buffer, None)
            return Message(peer=b"", header=header, tensors=payload_views(header, chunks, max_bytes=self._max_message_bytes))
        if kind == BOARD and len(frames) == 3 and self.shared.board is not None:
            header = decode_header(frames[1].buffer)
            payload, still_current, release = self.shared.board.read(frames[2].buffer, header.payload_bytes)
            tensors = board_payload_views(header, payload, max_bytes=self._max_message_bytes)
            return Message(peer=b"", header=header, tensors=tensors, still_current=still_current, release=release)
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

    def _watch(self) -> None:
        """Take the monitors' events waiting."""
        for monitor, link in zip(self._monitors, self._links, strict=True):
            while monitor.poll(0):
                frames = monitor.recv_multipart()
                if frames and len(frames[0]) >= 2:
                    link.see(struct.unpack_from("=H", frames[0])[0])

    def connection_dropped(self) -> bool:
        self._watch()
        return any([link.take_dropped() for link in self._links])  # a list: every lane's flag is taken

    def link_problem(self) -> str | None:
        """The first lane's problem that its monitor's events tell for certain (see :class:`LinkWatch`)."""
        self._watch()
        return next((problem for link in self._links if (problem := link.problem()) is not None), None)

    def link_state(self) -> str:
        """:meth:`link_problem`, else what lane 0's events tell."""
        return self.link_problem() or self._links[0].describe()

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
        allowed_keys: AbstractSet[str] | None = None,
        on_key_refused: Callable[[str], None] | None = None,
    ) -> None:
        """``max_frame_bytes`` (``None``: :func:`default_max_frame_bytes`), ``max_header_bytes`` and
        ``max_peers`` are the limits of the server endpoints it binds (see :class:`ZmqServer`);
        ``same_host_window_bytes`` the shared window a server gives each same-host connection, each
        way (0: none); ``shared_memory`` whether clients ask for one; ``allowed_keys`` the public keys
        (z85) ``curve_server`` lets in, where the caller read its allow-list already (default: read
        from its directory at bind); ``on_key_refused`` hears the key of each client refused."""
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
        self._allowed_keys = allowed_keys
        self._on_key_refused = on_key_refused
        self._curve_client = curve_client
        self._authenticator: ThreadAuthenticator | None = None
        self._pollers: dict[tuple[zmq.Socket, ...], zmq.Poller] = {}

    def bind(self, url: str) -> ZmqServer:
        if self._curve_server is not None and self._authenticator is None:
            # ZAP handler: only clients whose public key is in the allow-list complete the handshake.
            self._authenticator = ThreadAuthenticator(self._context, log=logging.getLogger("netoptim.curve"))
            self._authenticator.start()
            keys = self._allowed_keys if self._allowed_keys is not None else AllowList.load(self._curve_server.allowed_keys_dir).public_keys
            self._authenticator.configure_curve_callback(domain="*", credentials_provider=AllowedKeys(keys, self._on_key_refused))
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
