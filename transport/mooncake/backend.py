"""Mooncake Transfer Engine backend: tensor bytes by one-sided writes, headers over ZeroMQ.

Every connection has, on each side, a *receive window*: one buffer registered with the engine when
the connection opens and reused for its whole life, cut into slots of ``chunk_bytes``
(:mod:`transport.mooncake.link`). The two sides exchange their engine's address and their window's
base address in a handshake (``H``) on the ZeroMQ control channel. To send a message, the sender
takes free slots of the peer's window and starts one batched, asynchronous one-sided write of the
payload's chunks into them; once the engine reports the write complete, it sends the header and the
slot list (``M``) on the control channel, in the order the messages were sent. The receiver hands
out views of its window (no copy) and gives each slot back (``C``, a credit) once the last view of it
is gone. A sender that dies mid-write never sends the header, so nothing half-written is delivered.
Before the handshake completes, a payload goes inline on the control channel (``I``), so a first
message never waits for the peer to answer.

Completed writes, credits and queued headers are processed on every call into an endpoint (send,
recv, polling, a send handle's ``done``/``wait``): a receiver must keep calling its endpoint, as a
node's loop and a waiting worker do.

The protocol of one connection's end lives in :mod:`transport.mooncake.side`; this module holds the
endpoints (a ROUTER-backed server, a DEALER-backed client) and the transport that owns the engine.

The engine's ``tcp`` protocol runs on any host (and in CI); ``rdma`` is the same code on RDMA NICs:
``mooncake://HOST:PORT`` and ``mooncake+rdma://HOST:PORT`` (the control channel listens on PORT).
"""

from __future__ import annotations

import logging
import socket as pysocket
import time
from collections.abc import Sequence

import zmq

from transport.interface import ClientEndpoint, Message, SendHandle, ServerEndpoint, Transport
from transport.mooncake.link import DEFAULT_WINDOW_BYTES, local_ip_towards, split_address, start_engine
from transport.mooncake.side import HANDSHAKE, ConnectionSide
from transport.wire import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    Header,
    Payload,
    WireError,
)
from transport.zeromq.backend import prepare_bind_url, tune_socket

log = logging.getLogger(__name__)


class MooncakeServer(ConnectionSide, ServerEndpoint):
    """The node side: a ROUTER control socket and one link per worker connection."""

    def __init__(self, context: zmq.Context, url: str, engine, engine_address: str, **sizes: int) -> None:
        protocol, host, port = split_address(url)
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        tune_socket(sock)
        sock.bind(prepare_bind_url(f"tcp://{host}:{port}"))
        super().__init__(sock, engine, engine_address, protocol, **sizes)
        scheme = url.partition("://")[0]
        self.address = f"{scheme}://" + sock.getsockopt_string(zmq.LAST_ENDPOINT).split("://", 1)[1]

    def _send_control(self, peer: bytes, frames: list[bytes]) -> None:
        try:
            self.socket.send_multipart([peer, *frames])
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise ConnectionError(f"peer {peer.hex()} is gone") from exc
            raise

    def on_handshake(self, peer: bytes, raw: bytes) -> None:
        link = self.new_link()
        try:
            link.accept(raw, peer)
        except WireError:
            link.close()
            raise
        old = self.links.pop(peer, None)
        if old is not None:
            old.close()
        self.links[peer] = link
        self._send_control(peer, [HANDSHAKE, link.describe(self.engine_address)])

    def _pump(self, timeout_s: float, *, copy: bool) -> Message | bool:
        """Handle one incoming frame set: the message, True (not a message), False (nothing came)."""
        self.progress()
        if not self.socket.poll(self.poll_ms(timeout_s)):
            return False
        frames = self.socket.recv_multipart()
        message = self.handle(frames[0], frames[1:], copy=copy)
        return message if message is not None else True

    def recv(self, timeout_s: float) -> Message | None:
        if self.stash:
            return self.stash.popleft()
        deadline = time.monotonic() + timeout_s
        while True:
            got = self._pump(max(deadline - time.monotonic(), 0.0), copy=False)
            if isinstance(got, Message):
                return got
            if got is False and time.monotonic() >= deadline:
                return None

    def send(self, peer: bytes, header: Header, payload: Payload | None = None, *, track: bool = False) -> SendHandle:
        link = self.links.get(peer)
        if link is None or not link.ready:
            raise ConnectionError(f"peer {peer.hex()} is gone or never connected (no mooncake handshake from it)")

        def pump(timeout_s: float) -> bool:
            try:  # whatever arrives meanwhile is kept, copied out so its slots return at once
                got = self._pump(timeout_s, copy=True)
            except WireError as exc:
                log.warning("while waiting for window slots: %s", exc)
                return True
            if isinstance(got, Message):
                self.stash.append(got)
            return got is not False

        return self.enqueue(peer, link, header, payload, pump, f"peer {peer.hex()}")

    def close(self) -> None:
        self.socket.close(linger=0)
        self.close_links()


class MooncakeClient(ConnectionSide, ClientEndpoint):
    """The worker side of one connection: a DEALER control socket and one link."""

    def __init__(self, context: zmq.Context, url: str, engine, engine_address: str, **sizes: int) -> None:
        protocol, host, port = split_address(url)
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        tune_socket(sock)
        sock.connect(f"tcp://{host}:{port}")
        super().__init__(sock, engine, engine_address, protocol, **sizes)
        self.address = url
        self.links[b""] = self._link = self.new_link()
        self._send_control(b"", [HANDSHAKE, self._link.describe(engine_address)])

    def _send_control(self, peer: bytes, frames: list[bytes]) -> None:
        self.socket.send_multipart(frames)

    def on_handshake(self, peer: bytes, raw: bytes) -> None:
        self._link.accept(raw)

    def pump(self, timeout_s: float, *, copy: bool = False) -> bool:
        """Handle one incoming frame set (a message goes to the stash); False after ``timeout_s``."""
        self.progress()
        if not self.socket.poll(self.poll_ms(timeout_s)):
            return False
        message = self.handle(b"", self.socket.recv_multipart(), copy=copy)
        if message is not None:
            self.stash.append(message)
        return True

    def send(self, header: Header, payload: Payload | None = None) -> SendHandle:
        return self.enqueue(b"", self._link, header, payload, lambda timeout_s: self.pump(timeout_s, copy=True), self.address)

    def send_raw(self, frames: Sequence[bytes]) -> None:
        """Send arbitrary control frames; only for tests of how a node treats bad input."""
        self.socket.send_multipart(list(frames))

    def recv(self, timeout_s: float) -> Message | None:
        deadline = time.monotonic() + timeout_s
        while not self.stash:
            if not self.pump(max(deadline - time.monotonic(), 0.0)) and time.monotonic() >= deadline:
                return None
        return self.stash.popleft()

    def close(self) -> None:
        deadline = time.monotonic() + 5
        while self.outgoing and time.monotonic() < deadline:  # let queued messages go, as a ZeroMQ linger would
            self.progress()
            time.sleep(0.0005)
        self.socket.close()
        self.stash.clear()
        self.close_links()


class MooncakeTransport(Transport):
    """Owns one transfer engine (started on first use) and the control channel's ZeroMQ context."""

    def __init__(
        self,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        curve_server: object = None,
        curve_client: object = None,
        connections_per_peer: int = 1,
        io_threads: int = 1,
    ) -> None:
        if connections_per_peer != 1:
            raise ValueError("the Mooncake engine opens its own connections per peer: set MC_TCP_LANES_PER_PEER (tcp) or MC_NUM_QP_PER_EP (rdma) instead")
        if curve_server is not None or curve_client is not None:
            raise ValueError("CURVE encrypts ZeroMQ's data plane; the mooncake transport does not encrypt: use tcp:// with CURVE, or a trusted network")
        if window_bytes < chunk_bytes:
            raise ValueError(f"window_bytes ({window_bytes}) must hold at least one chunk of {chunk_bytes} bytes")
        self._sizes = {"chunk_bytes": chunk_bytes, "window_bytes": window_bytes, "max_message_bytes": max_message_bytes}
        self._context = zmq.Context(io_threads=io_threads)  # the control channel's; payloads move in the engine
        self._engine = None
        self._engine_address = ""

    def _ensure_engine(self, host: str, protocol: str) -> None:
        if self._engine is None:
            self._engine = start_engine(host, protocol)
            self._engine_address = f"{host}:{self._engine.get_rpc_port()}"

    def bind(self, url: str) -> MooncakeServer:
        protocol, host, _port = split_address(url)
        self._ensure_engine(pysocket.gethostbyname(pysocket.gethostname()) if host in ("0.0.0.0", "*") else host, protocol)
        return MooncakeServer(self._context, url, self._engine, self._engine_address, **self._sizes)

    def connect(self, url: str) -> MooncakeClient:
        protocol, host, _port = split_address(url)
        self._ensure_engine(local_ip_towards(host), protocol)
        return MooncakeClient(self._context, url, self._engine, self._engine_address, **self._sizes)

    def wait_readable(self, clients: Sequence[ClientEndpoint], timeout_s: float) -> list[int]:
        endpoints = [client for client in clients if isinstance(client, MooncakeClient)]
        assert len(endpoints) == len(clients), "a mooncake transport waits on its own endpoints only"
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        for client in endpoints:
            poller.register(client.socket, zmq.POLLIN)
        while True:
            for client in endpoints:
                client.progress()
            ready = [index for index, client in enumerate(endpoints) if client.stash]
            if ready:
                return ready
            remaining = max(deadline - time.monotonic(), 0.0)
            events = dict(poller.poll(min(client.poll_ms(remaining) for client in endpoints)))
            for client in endpoints:
                if events.get(client.socket):
                    client.pump(0)
            if not events and time.monotonic() >= deadline:
                return []

    def close(self) -> None:
        self._context.term()
        self._engine = None
