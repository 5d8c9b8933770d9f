"""Mooncake Transfer Engine backend: tensor bytes by one-sided writes, headers over ZeroMQ.

Every connection has, on each side, a *receive window*: one buffer registered with the engine when
the connection opens and reused for its whole life, cut into slots of ``chunk_bytes``. The two sides
exchange their engine's address and their window's base address in a handshake (``H``) on the
ZeroMQ control channel. To send a message, the sender takes free slots of the peer's window, writes
the payload's chunks into them with one batched one-sided write (from the payload itself when it
lies in registered memory, else staged through a registered buffer), and only then sends the header
and the slot list (``M``) on the control channel. Before the handshake completes, a payload goes
inline on the control channel (``I``), so a first message never waits for the peer to answer. The receiver hands out views of its window (no
copy) and gives each slot back (``C``, a credit) once the last view of it is gone. A sender that
dies mid-write never sends the header, so nothing half-written is ever delivered.

The engine's ``tcp`` protocol runs on any host (and in CI); ``rdma`` is the same code on RDMA NICs:
``mooncake://HOST:PORT`` and ``mooncake+rdma://HOST:PORT`` (the control channel listens on PORT).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import socket as pysocket
import time
import weakref
from collections.abc import Callable, Sequence

import msgpack
import numpy as np
import torch
import zmq

from transport.interface import ClientEndpoint, Message, SendHandle, ServerEndpoint, Transport
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

DEFAULT_WINDOW_BYTES = 64 << 20
"""Receive window per connection and direction; one message's payload must fit in it."""

CREDIT_TIMEOUT_S = 60.0
INSTALL_HINT = (
    "the mooncake transport needs the Mooncake Transfer Engine: `pip install 'netoptim[rdma]'` "
    "(mooncake-transfer-engine-non-cuda) and the system libraries libibverbs1 librdmacm1 libnuma1 "
    "(Debian/Ubuntu: `apt-get install libibverbs1 librdmacm1 libnuma1`), needed even for its tcp protocol"
)
_HANDSHAKE, _MESSAGE, _INLINE, _CREDIT = b"H", b"M", b"I", b"C"
_PROTOCOLS = {"mooncake": "tcp", "mooncake+rdma": "rdma"}


class TransportUnavailable(RuntimeError):
    """The backend's library is not installed here; the message says what to install."""


def _start_engine(host: str, protocol: str):  # -> mooncake.engine.TransferEngine
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # the engine logs every connection at INFO otherwise
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # the package, or a system library it links (libibverbs.so.1, ...)
        raise TransportUnavailable(f"{INSTALL_HINT} ({exc})") from None
    engine = TransferEngine()
    status = engine.initialize(f"{host}:0", "P2PHANDSHAKE", protocol, "")
    if status != 0:
        hint = "; is there an RDMA NIC and its driver? (mooncake:// uses TCP)" if protocol == "rdma" else ""
        raise ConnectionError(f"the Mooncake transfer engine did not start on {host} with protocol {protocol!r} (status {status}){hint}")
    return engine


def _split(url: str) -> tuple[str, str, str]:
    """``(protocol, host, port)`` of a ``mooncake://`` or ``mooncake+rdma://`` address."""
    scheme, _, rest = url.partition("://")
    host, sep, port = rest.rpartition(":")
    if scheme not in _PROTOCOLS or not sep or not host or not port:
        raise ValueError(f"address {url!r}: expected mooncake://HOST:PORT or mooncake+rdma://HOST:PORT")
    return _PROTOCOLS[scheme], host, port


def _local_ip_towards(host: str) -> str:
    """The address of this host's interface that routes to ``host`` (no packet is sent)."""
    with pysocket.socket(pysocket.AF_INET, pysocket.SOCK_DGRAM) as probe:
        probe.connect((pysocket.gethostbyname(host), 9))
        return probe.getsockname()[0]


class _Done(SendHandle):
    """Writes complete before ``send`` returns: the payload may be reused at once."""

    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> None:
        return None


class _Link:
    """One connection: our receive window (the peer writes into it), the peer's window (we write into
    it), a staging buffer for payloads outside registered memory, and the credits in both directions."""

    def __init__(self, engine, window_bytes: int, slot_bytes: int) -> None:
        self.engine = engine
        self.slot_bytes = slot_bytes
        self.window = torch.empty(window_bytes, dtype=torch.uint8)
        if engine.register_memory(self.window.data_ptr(), window_bytes) != 0:
            raise ConnectionError("the Mooncake engine could not register a receive window")
        self.staging: torch.Tensor | None = None  # registered on the first staged send
        self.remote_engine = ""
        self.remote_base = 0
        self.remote_free: collections.deque[int] = collections.deque()
        self.returned: collections.deque[int] = collections.deque()  # our slots released, credit not sent yet
        self.outstanding = 0  # our slots handed out in messages and not returned

    @property
    def ready(self) -> bool:
        return bool(self.remote_engine)

    @property
    def slots(self) -> int:
        return self.window.numel() // self.slot_bytes

    def describe(self, engine_address: str) -> bytes:
        return msgpack.packb({"engine": engine_address, "base": self.window.data_ptr(), "slots": self.slots, "slot_bytes": self.slot_bytes})

    def accept(self, raw: bytes, peer: bytes = b"") -> None:
        try:
            info = msgpack.unpackb(raw)
            engine, base, slots, slot_bytes = info["engine"], int(info["base"]), int(info["slots"]), int(info["slot_bytes"])
        except Exception:
            raise WireError(ErrorCode.MALFORMED, "the mooncake handshake is not a window description", peer=peer) from None
        if slot_bytes != self.slot_bytes:
            raise WireError(
                ErrorCode.BAD_PAYLOAD,
                f"the peer cuts payloads in {slot_bytes}-byte chunks, this side in {self.slot_bytes}: give both the same chunk size",
                peer=peer,
            )
        self.remote_engine, self.remote_base = str(engine), base
        self.remote_free = collections.deque(range(slots))

    def staging_slot(self, slot: int) -> torch.Tensor:
        if self.staging is None:
            self.staging = torch.empty(self.window.numel(), dtype=torch.uint8)
            if self.engine.register_memory(self.staging.data_ptr(), self.staging.numel()) != 0:
                raise ConnectionError("the Mooncake engine could not register a staging buffer")
        return self.staging[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]

    def view(self, slot: int, size: int, *, copy: bool) -> memoryview:
        """The first ``size`` bytes of our slot ``slot``: a view that gives the slot back when the last
        reference to it goes, or (``copy``) a copy, and the slot is given back at once."""
        address = self.window.data_ptr() + slot * self.slot_bytes
        self.outstanding += 1
        if copy:
            data = memoryview(bytearray(ctypes.string_at(address, size)))
            self.release(slot)
            return data
        region = (ctypes.c_char * size).from_address(address)
        weakref.finalize(region, self.release, slot)  # runs in whichever thread drops the last view
        return memoryview(region)

    def release(self, slot: int) -> None:
        self.returned.append(slot)  # deque.append is atomic: safe from a finalizer in another thread
        self.outstanding -= 1

    def take_credits(self) -> list[int]:
        credits = []
        while self.returned:
            credits.append(self.returned.popleft())
        return credits

    def close(self) -> None:
        for buffer in (self.window, self.staging):
            if buffer is not None:
                self.engine.unregister_memory(buffer.data_ptr())


def _address_in(chunk: memoryview, regions: Sequence[tuple[int, int]]) -> int | None:
    """The address of ``chunk`` when it lies inside one of the registered ``regions``."""
    start = np.frombuffer(chunk, dtype=np.uint8).ctypes.data
    for base, length in regions:
        if base <= start and start + len(chunk) <= base + length:
            return start
    return None


class _Side:
    """What both ends of a connection do: write payloads, read messages, hand back credits."""

    def __init__(self, sock: zmq.Socket, engine, engine_address: str, *, chunk_bytes: int, window_bytes: int, max_message_bytes: int) -> None:
        self.socket = sock
        self.engine = engine
        self.engine_address = engine_address
        self.chunk_bytes = chunk_bytes
        self.window_bytes = max(window_bytes - window_bytes % chunk_bytes, chunk_bytes)
        self.max_message_bytes = min(max_message_bytes, self.window_bytes)
        self.stash: collections.deque[Message] = collections.deque()
        self.links: dict[bytes, _Link] = {}
        self.written_bytes = 0  # payload bytes sent by one-sided writes
        self.staged_bytes = 0  # of those, bytes copied into a staging buffer first
        self.inline_bytes = 0  # payload bytes sent on the control channel (before the handshake)

    def _send_control(self, peer: bytes, frames: list[bytes]) -> None:
        raise NotImplementedError

    def new_link(self) -> _Link:
        return _Link(self.engine, self.window_bytes, self.chunk_bytes)

    def flush_credits(self) -> None:
        for peer, link in list(self.links.items()):
            credits = link.take_credits()
            if credits:
                try:
                    self._send_control(peer, [_CREDIT, msgpack.packb(credits)])
                except ConnectionError:
                    self.links.pop(peer, None)  # the peer is gone; its window goes with it

    def holding(self) -> bool:
        """True while views of our windows are out: their credits go out on a later call."""
        return any(link.outstanding or link.returned for link in self.links.values())

    def write(self, link: _Link, payload: Payload | None, pump: Callable[[float], bool], peer_name: str) -> list[int]:
        """Write ``payload`` into free slots of the peer's window; returns the slots used."""
        chunks = payload_chunks(payload, self.chunk_bytes)
        if not chunks:
            return []
        total = sum(len(chunk) for chunk in chunks)
        if len(chunks) > link.slots or total > self.max_message_bytes:
            raise ValueError(f"a payload of {total} bytes is larger than the {self.window_bytes}-byte receive window: raise window_bytes on both sides")
        deadline = time.monotonic() + CREDIT_TIMEOUT_S
        while len(link.remote_free) < len(chunks):
            if not pump(max(deadline - time.monotonic(), 0.0)) and time.monotonic() >= deadline:
                raise TimeoutError(f"{peer_name} gave no window slots back for {CREDIT_TIMEOUT_S:.0f} s: is it still reading?")
        slots = [link.remote_free.popleft() for _ in chunks]
        registered = [(link.window.data_ptr(), link.window.numel())] + [(other.window.data_ptr(), other.window.numel()) for other in self.links.values()]
        sources, targets, lengths = [], [], []
        for slot, chunk in zip(slots, chunks, strict=True):
            source = _address_in(chunk, registered)
            if source is None:  # stage it: the engine writes from registered memory only
                staged = link.staging_slot(slot)[: len(chunk)]
                staged.copy_(torch.frombuffer(chunk, dtype=torch.uint8))
                source = staged.data_ptr()
                self.staged_bytes += len(chunk)
            sources.append(source)
            targets.append(link.remote_base + slot * self.chunk_bytes)
            lengths.append(len(chunk))
        status = self.engine.batch_transfer_sync_write(link.remote_engine, sources, targets, lengths)
        if status != 0:
            link.remote_free.extend(slots)
            raise ConnectionError(f"the one-sided write to {peer_name} failed (status {status}): is the peer still running?")
        self.written_bytes += total
        return slots

    def read(self, link: _Link | None, frames: list[bytes], peer: bytes, *, copy: bool) -> Message:
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
            if link is not None:  # the slots are ours again: nothing will read them
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
                credits = msgpack.unpackb(rest[0])
            except Exception:
                raise WireError(ErrorCode.MALFORMED, "a credit frame that is not msgpack", peer=peer) from None
            link.remote_free.extend(int(slot) for slot in credits)
            return None
        if kind == _HANDSHAKE and len(rest) == 1:
            self.on_handshake(peer, rest[0])
            return None
        raise WireError(ErrorCode.MALFORMED, f"not a mooncake transport frame (kind {kind[:8]!r}, {len(frames)} frames)", peer=peer or None)

    def on_handshake(self, peer: bytes, raw: bytes) -> None:
        raise NotImplementedError

    def close_links(self) -> None:
        for link in self.links.values():
            link.close()
        self.links.clear()


class MooncakeServer(_Side, ServerEndpoint):
    """The node side: a ROUTER control socket and one link per worker connection."""

    def __init__(self, context: zmq.Context, url: str, engine, engine_address: str, **sizes: int) -> None:
        _protocol, host, port = _split(url)
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        tune_socket(sock)
        sock.bind(prepare_bind_url(f"tcp://{host}:{port}"))
        super().__init__(sock, engine, engine_address, **sizes)
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
        old = self.links.pop(peer, None)
        if old is not None:
            old.close()
        link = self.new_link()
        try:
            link.accept(raw, peer)
        except WireError:
            link.close()
            raise
        self.links[peer] = link
        self._send_control(peer, [_HANDSHAKE, link.describe(self.engine_address)])

    def _pump(self, timeout_s: float, *, copy: bool) -> Message | bool | None:
        self.flush_credits()
        wait_ms = int(timeout_s * 1000)
        if not self.socket.poll(min(wait_ms, 20) if self.holding() else wait_ms):
            return False
        frames = self.socket.recv_multipart()
        return self.handle(frames[0], frames[1:], copy=copy)

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
        slots: list[int] = []
        if payload is not None and header.num_chunks:
            if link is None or not link.ready:
                raise ConnectionError(f"peer {peer.hex()} has no mooncake connection (no handshake, or it is gone)")

            def pump(timeout_s: float) -> bool:
                try:  # whatever arrives meanwhile is kept, copied out so its slots return at once
                    got = self._pump(timeout_s, copy=True)
                except WireError as exc:
                    log.warning("while waiting for window slots: %s", exc)
                    return True
                if isinstance(got, Message):
                    self.stash.append(got)
                return got is not False

            slots = self.write(link, payload, pump, f"peer {peer.hex()}")
        self._send_control(peer, [_MESSAGE, encode_header(header), msgpack.packb(slots)])
        return _Done()

    def close(self) -> None:
        self.socket.close(linger=0)
        self.close_links()


class MooncakeClient(_Side, ClientEndpoint):
    """The worker side of one connection: a DEALER control socket and one link."""

    def __init__(self, context: zmq.Context, url: str, engine, engine_address: str, **sizes: int) -> None:
        _protocol, host, port = _split(url)
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        tune_socket(sock)
        sock.connect(f"tcp://{host}:{port}")
        super().__init__(sock, engine, engine_address, **sizes)
        self.address = url
        self.links[b""] = self._link = self.new_link()
        self._send_control(b"", [_HANDSHAKE, self._link.describe(engine_address)])

    def _send_control(self, peer: bytes, frames: list[bytes]) -> None:
        self.socket.send_multipart(frames)

    def on_handshake(self, peer: bytes, raw: bytes) -> None:
        self._link.accept(raw)

    def pump(self, timeout_s: float, *, copy: bool = False) -> bool:
        """Handle one incoming frame set (a message goes to the stash); False after ``timeout_s``."""
        self.flush_credits()
        wait_ms = int(timeout_s * 1000)
        if not self.socket.poll(min(wait_ms, 20) if self.holding() else wait_ms):
            return False
        message = self.handle(b"", self.socket.recv_multipart(), copy=copy)
        if message is not None:
            self.stash.append(message)
        return True

    def send(self, header: Header, payload: Payload | None = None) -> SendHandle:
        slots: list[int] = []
        self.flush_credits()
        if payload is not None and header.num_chunks:
            if not self._link.ready:  # no window to write into yet: the bytes go inline (copied)
                chunks = [bytes(chunk) for chunk in payload_chunks(payload, self.chunk_bytes)]
                self._send_control(b"", [_INLINE, encode_header(header), *chunks])
                self.inline_bytes += sum(len(chunk) for chunk in chunks)
                return _Done()
            slots = self.write(self._link, payload, lambda timeout_s: self.pump(timeout_s, copy=True), self.address)
        self._send_control(b"", [_MESSAGE, encode_header(header), msgpack.packb(slots)])
        return _Done()

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
    ) -> None:
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
            self._engine = _start_engine(host, protocol)
            self._engine_address = f"{host}:{self._engine.get_rpc_port()}"

    def bind(self, url: str) -> MooncakeServer:
        protocol, host, _port = _split(url)
        self._ensure_engine(pysocket.gethostbyname(pysocket.gethostname()) if host in ("0.0.0.0", "*") else host, protocol)
        return MooncakeServer(self._context, url, self._engine, self._engine_address, **self._sizes)

    def connect(self, url: str) -> MooncakeClient:
        protocol, host, _port = _split(url)
        self._ensure_engine(_local_ip_towards(host), protocol)
        return MooncakeClient(self._context, url, self._engine, self._engine_address, **self._sizes)

    def wait_readable(self, clients: Sequence[ClientEndpoint], timeout_s: float) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while True:
            ready = [index for index, client in enumerate(clients) if client.stash]  # type: ignore[attr-defined]
            if ready:
                return ready
            for client in clients:
                client.flush_credits()  # type: ignore[attr-defined]
            holding = any(client.holding() for client in clients)  # type: ignore[attr-defined]
            poller = zmq.Poller()
            for client in clients:
                poller.register(client.socket, zmq.POLLIN)  # type: ignore[attr-defined]
            remaining_ms = max(int((deadline - time.monotonic()) * 1000), 0)
            events = dict(poller.poll(min(remaining_ms, 20) if holding else remaining_ms))
            for client in clients:
                if events.get(client.socket):  # type: ignore[attr-defined]
                    client.pump(0)  # type: ignore[attr-defined]
            if not events and time.monotonic() >= deadline:
                return []

    def close(self) -> None:
        self._context.term()
        self._engine = None
