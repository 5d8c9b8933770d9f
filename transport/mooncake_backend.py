"""Mooncake Transfer Engine backend: tensor bytes by one-sided writes, headers over ZeroMQ.

Every connection has, on each side, a *receive window*: one buffer registered with the engine when
the connection opens and reused for its whole life, cut into slots of ``chunk_bytes``
(:mod:`transport.mooncake_link`). The two sides exchange their engine's address and their window's
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

The engine's ``tcp`` protocol runs on any host (and in CI); ``rdma`` is the same code on RDMA NICs:
``mooncake://HOST:PORT`` and ``mooncake+rdma://HOST:PORT`` (the control channel listens on PORT).
"""

from __future__ import annotations

import collections
import logging
import socket as pysocket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import torch
import zmq

from transport.interface import ClientEndpoint, Message, SendHandle, ServerEndpoint, Transport
from transport.mooncake_link import CREDIT_TIMEOUT_S, DEFAULT_WINDOW_BYTES, Link, local_ip_towards, split_address, start_engine
from transport.wire import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    ErrorCode,
    Header,
    Payload,
    WireError,
    decode_header,
    encode_header,
    payload_chunks,
    payload_views,
)
from transport.zmq_backend import prepare_bind_url, tune_socket

log = logging.getLogger(__name__)

_HANDSHAKE, _MESSAGE, _INLINE, _CREDIT = b"H", b"M", b"I", b"C"
_BUSY_POLL_MS = 1
"""Poll slice while writes are in flight or views are out: their completions and credits need a call."""


class _WriteHandle(SendHandle):
    """Done once the write has completed and the header is sent (the payload may then be reused)."""

    def __init__(self, side: _Side) -> None:
        self._side = side
        self.finished = False

    def done(self) -> bool:
        if not self.finished:
            self._side.progress()
        return self.finished

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.done():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"a one-sided write did not complete within {timeout_s:.1f} s")
            time.sleep(0.0002)


@dataclass(slots=True)
class _Outgoing:
    """A message whose header goes out once its write (if any) is complete, in send order."""

    peer: bytes
    frames: list[bytes]
    handle: _WriteHandle
    batch_ids: list[int] | None = None  # one per chunk: the engine reports a batch's first task only
    link: Link | None = None
    slots: tuple[int, ...] = ()
    keep: object = None  # the payload's chunks: the engine reads them until the write completes


def _address_in(chunk: memoryview, regions: Sequence[tuple[int, int]]) -> int | None:
    """The address of ``chunk`` when it lies inside one of the registered ``regions``."""
    start = np.frombuffer(chunk, dtype=np.uint8).ctypes.data
    for base, length in regions:
        if base <= start and start + len(chunk) <= base + length:
            return start
    return None


class _Side:
    """What both ends of a connection do: write payloads, read messages, hand back credits."""

    def __init__(self, sock: zmq.Socket, engine, engine_address: str, protocol: str, *, chunk_bytes: int, window_bytes: int, max_message_bytes: int) -> None:
        self.socket = sock
        self.engine = engine
        self.engine_address = engine_address
        # Over TCP the engine reads the source with an ordinary send(), so any memory will do; an RDMA
        # NIC reads only registered memory, so payloads outside it are staged in a registered buffer.
        self.direct_sources = protocol == "tcp"
        self.chunk_bytes = chunk_bytes
        self.window_bytes = max(window_bytes - window_bytes % chunk_bytes, chunk_bytes)
        self.max_message_bytes = min(max_message_bytes, self.window_bytes)
        self.stash: collections.deque[Message] = collections.deque()
        self.links: dict[bytes, Link] = {}
        self.outgoing: collections.deque[_Outgoing] = collections.deque()
        self.written_bytes = 0  # payload bytes sent by one-sided writes
        self.staged_bytes = 0  # of those, bytes copied into a staging buffer first
        self.inline_bytes = 0  # payload bytes sent on the control channel (before the handshake)

    def _send_control(self, peer: bytes, frames: list[bytes]) -> None:
        raise NotImplementedError

    def on_handshake(self, peer: bytes, raw: bytes) -> None:
        raise NotImplementedError

    def new_link(self) -> Link:
        return Link(self.engine, self.window_bytes, self.chunk_bytes)

    # ------------------------------------------------------------ progress

    def progress(self) -> None:
        """Send the headers of completed writes (in order) and the credits of released slots."""
        while self.outgoing:
            item = self.outgoing[0]
            if item.batch_ids:
                status = self.engine.transfer_check_status(item.batch_ids[-1])
                while status == 1 and len(item.batch_ids) > 1:
                    item.batch_ids.pop()
                    status = self.engine.transfer_check_status(item.batch_ids[-1])
                if status == 0:
                    break  # in flight; later messages wait behind it
                if status != 1:
                    self.outgoing.popleft()
                    item.handle.finished = True
                    log.error("a one-sided write to peer %s failed (status %d); the message is dropped", item.peer.hex() or "node", status)
                    continue
            self.outgoing.popleft()
            item.handle.finished = True
            try:
                self._send_control(item.peer, item.frames)
            except ConnectionError as exc:
                log.warning("%s; its message is dropped", exc)
        for peer, link in list(self.links.items()):
            credits = link.take_credits()
            if credits:
                try:
                    self._send_control(peer, [_CREDIT, msgpack.packb(credits)])
                except ConnectionError:
                    self.links.pop(peer, None)  # the peer is gone; its window goes with it

    def busy(self) -> bool:
        """True while writes are in flight or views of our windows are out: both need later calls."""
        return bool(self.outgoing) or any(link.outstanding for link in self.links.values())

    def poll_ms(self, timeout_s: float) -> int:
        wait_ms = max(int(timeout_s * 1000), 0)
        return min(wait_ms, _BUSY_POLL_MS) if self.busy() else wait_ms

    # ------------------------------------------------------------ sending

    def enqueue(self, peer: bytes, link: Link | None, header: Header, payload: Payload | None, pump: Callable[[float], bool], peer_name: str) -> SendHandle:
        """Start the write of ``payload`` into the peer's window and queue the header behind it."""
        handle = _WriteHandle(self)
        chunks = payload_chunks(payload, self.chunk_bytes) if header.num_chunks else []
        if chunks and (link is None or not link.ready):  # no window to write into yet: inline (copied)
            frames = [bytes(chunk) for chunk in chunks]
            self.inline_bytes += sum(len(frame) for frame in frames)
            self.outgoing.append(_Outgoing(peer, [_INLINE, encode_header(header), *frames], handle))
        elif chunks:
            assert link is not None
            batch_ids, slots = self._write(link, chunks, pump, peer_name)
            frames = [_MESSAGE, encode_header(header), msgpack.packb(slots)]
            self.outgoing.append(_Outgoing(peer, frames, handle, batch_ids, link, tuple(slots), chunks))
        else:
            self.outgoing.append(_Outgoing(peer, [_MESSAGE, encode_header(header), msgpack.packb([])], handle))
        self.progress()
        return handle

    def _write(self, link: Link, chunks: list[memoryview], pump: Callable[[float], bool], peer_name: str) -> tuple[list[int], list[int]]:
        total = sum(len(chunk) for chunk in chunks)
        if len(chunks) > link.slots or total > self.max_message_bytes:
            raise ValueError(f"a payload of {total} bytes is larger than the {self.window_bytes}-byte receive window: raise window_bytes on both sides")
        deadline = time.monotonic() + CREDIT_TIMEOUT_S
        while len(link.remote_free) < len(chunks):
            if not pump(max(deadline - time.monotonic(), 0.0)) and time.monotonic() >= deadline:
                raise TimeoutError(f"{peer_name} gave no window slots back for {CREDIT_TIMEOUT_S:.0f} s: is it still reading?")
        slots = [link.remote_free.popleft() for _ in chunks]
        registered = [(other.window.data_ptr(), other.window.numel()) for other in self.links.values()]
        sources, targets, lengths = [], [], []
        for slot, chunk in zip(slots, chunks, strict=True):
            source = np.frombuffer(chunk, dtype=np.uint8).ctypes.data if self.direct_sources else _address_in(chunk, registered)
            if source is None:  # stage it: the NIC reads registered memory only
                staged = link.staging_slot(slot)[: len(chunk)]
                staged.copy_(torch.frombuffer(chunk, dtype=torch.uint8))
                source = staged.data_ptr()
                self.staged_bytes += len(chunk)
            sources.append(source)
            targets.append(link.remote_base + slot * self.chunk_bytes)
            lengths.append(len(chunk))
        batch_ids = [self.engine.batch_transfer_async_write(link.remote_engine, [a], [b], [n]) for a, b, n in zip(sources, targets, lengths, strict=True)]
        if min(batch_ids) < 0:
            # Slots a started write may still land in are not given back: the peer never reads them.
            raise ConnectionError(f"the one-sided write to {peer_name} could not start (status {min(batch_ids)}): is the peer still running?")
        self.written_bytes += total
        return batch_ids, slots

    # ------------------------------------------------------------ receiving

    def read(self, link: Link | None, frames: list[bytes], peer: bytes, *, copy: bool) -> Message:
        """The message whose header and slot list are ``frames``; its payload is in our window."""
        if len(frames) != 2:
            raise WireError(ErrorCode.MALFORMED, f"a mooncake message has a header and a slot list, not {len(frames)} frames", peer=peer)
        try:
            slots = msgpack.unpackb(frames[1])
        except Exception:
            raise WireError(ErrorCode.MALFORMED, "the slot list is not msgpack", peer=peer) from None
        if slots and link is None:
            raise WireError(ErrorCode.BAD_PAYLOAD, "a payload before the connection's handshake", peer=peer)
        total_slots = link.slots if link is not None else 0
        if not isinstance(slots, list) or not all(isinstance(s, int) and 0 <= s < total_slots for s in slots) or len(set(slots)) != len(slots):
            raise WireError(ErrorCode.BAD_PAYLOAD, f"the slot list {str(slots)[:80]} names slots outside the window", peer=peer)
        try:
            header = decode_header(frames[0], peer=peer)
            if header.num_chunks != len(slots):
                raise WireError(ErrorCode.BAD_PAYLOAD, f"header declares {header.num_chunks} chunks, the slot list names {len(slots)}", peer=peer)
            if header.payload_bytes > self.max_message_bytes:
                raise WireError(ErrorCode.TOO_LARGE, f"payload of {header.payload_bytes} bytes is over the limit of {self.max_message_bytes}", peer=peer)
        except WireError:
            if link is not None:  # the peer wrote them for this message: nothing will read them now
                link.outstanding += len(slots)
                link.returned.extend(slots)
            raise
        chunks, remaining = [], header.payload_bytes
        for slot in slots:
            size = max(min(self.chunk_bytes, remaining), 0)
            chunks.append(link.view(slot, size, copy=copy))  # type: ignore[union-attr]
            remaining -= size
        return Message(peer=peer, header=header, tensors=payload_views(header, chunks, max_bytes=self.max_message_bytes, peer=peer))

    def handle(self, peer: bytes, frames: list[bytes], *, copy: bool) -> Message | None:
        """One incoming frame set: a message, or ``None`` for handshakes and credits."""
        kind, rest = (frames[0], frames[1:]) if frames else (b"", [])
        link = self.links.get(peer)
        if kind == _MESSAGE:
            return self.read(link, rest, peer, copy=copy)
        if kind == _INLINE and rest:
            header = decode_header(rest[0], peer=peer)
            views = payload_views(header, [memoryview(frame) for frame in rest[1:]], max_bytes=self.max_message_bytes, peer=peer)
            return Message(peer=peer, header=header, tensors=views)
        if kind == _CREDIT and len(rest) == 1 and link is not None:
            try:
                credits = [int(slot) for slot in msgpack.unpackb(rest[0])]
            except Exception:
                raise WireError(ErrorCode.MALFORMED, "a credit frame that is not a list of slots", peer=peer) from None
            link.remote_free.extend(credits)
            return None
        if kind == _HANDSHAKE and len(rest) == 1:
            self.on_handshake(peer, rest[0])
            return None
        raise WireError(ErrorCode.MALFORMED, f"not a mooncake transport frame (kind {kind[:8]!r}, {len(frames)} frames)", peer=peer or None)

    def close_links(self) -> None:
        self.outgoing.clear()
        for link in self.links.values():
            link.close()
        self.links.clear()


class MooncakeServer(_Side, ServerEndpoint):
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
        self._send_control(peer, [_HANDSHAKE, link.describe(self.engine_address)])

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

    def send(self, peer: bytes, header: Header, payload: Payload | None = None) -> SendHandle:
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


class MooncakeClient(_Side, ClientEndpoint):
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
        self._send_control(b"", [_HANDSHAKE, self._link.describe(engine_address)])

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
    ) -> None:
        if connections_per_peer != 1:
            raise ValueError("the Mooncake engine opens its own connections per peer: set MC_TCP_LANES_PER_PEER (tcp) or MC_NUM_QP_PER_EP (rdma) instead")
        if curve_server is not None or curve_client is not None:
            raise ValueError("CURVE encrypts ZeroMQ's data plane; the mooncake transport does not encrypt: use tcp:// with CURVE, or a trusted network")
        if window_bytes < chunk_bytes:
            raise ValueError(f"window_bytes ({window_bytes}) must hold at least one chunk of {chunk_bytes} bytes")
        self._sizes = {"chunk_bytes": chunk_bytes, "window_bytes": window_bytes, "max_message_bytes": max_message_bytes}
        self._context = zmq.Context()
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
