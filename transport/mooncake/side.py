"""One end of a Mooncake connection: one-sided writes out, messages in, credits both ways.

The control frames on the ZeroMQ channel are ``H`` (handshake: engine address and window base),
``M`` (a header and the slot list its payload was written to), ``I`` (a header and its payload
inline, before the handshake) and ``C`` (slots given back). :class:`ConnectionSide` holds what the
server and the client endpoints (:mod:`transport.mooncake.backend`) share: the queue of messages
whose writes are in flight, the links to peers, and the handling of every incoming frame.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import torch
import zmq

from transport.interface import Message, SendHandle
from transport.mooncake.link import CREDIT_TIMEOUT_S, Link
from transport.payload_views import payload_views
from transport.wire import ErrorCode, Header, Payload, WireError, decode_header, encode_header, payload_chunks

log = logging.getLogger(__name__)

HANDSHAKE, MESSAGE, INLINE, CREDIT = b"H", b"M", b"I", b"C"
BUSY_POLL_MS = 1
"""Poll slice while writes are in flight or views are out: their completions and credits need a call."""


class _WriteHandle(SendHandle):
    """Done once the write has completed and the header is sent (the payload may then be reused)."""

    def __init__(self, side: ConnectionSide) -> None:
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


class ConnectionSide:
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
                    self._send_control(peer, [CREDIT, msgpack.packb(credits)])
                except ConnectionError:
                    self.links.pop(peer, None)  # the peer is gone; its window goes with it

    def busy(self) -> bool:
        """True while writes are in flight or views of our windows are out: both need later calls."""
        return bool(self.outgoing) or any(link.outstanding for link in self.links.values())

    def poll_ms(self, timeout_s: float) -> int:
        wait_ms = max(int(timeout_s * 1000), 0)
        return min(wait_ms, BUSY_POLL_MS) if self.busy() else wait_ms

    # ------------------------------------------------------------ sending

    def enqueue(self, peer: bytes, link: Link | None, header: Header, payload: Payload | None, pump: Callable[[float], bool], peer_name: str) -> SendHandle:
        """Start the write of ``payload`` into the peer's window and queue the header behind it."""
        handle = _WriteHandle(self)
        chunks = payload_chunks(payload, self.chunk_bytes) if header.num_chunks else []
        if chunks and (link is None or not link.ready):  # no window to write into yet: inline (copied)
            frames = [bytes(chunk) for chunk in chunks]
            self.inline_bytes += sum(len(frame) for frame in frames)
            self.outgoing.append(_Outgoing(peer, [INLINE, encode_header(header), *frames], handle))
        elif chunks:
            assert link is not None
            batch_ids, slots = self._write(link, chunks, pump, peer_name)
            frames = [MESSAGE, encode_header(header), msgpack.packb(slots)]
            self.outgoing.append(_Outgoing(peer, frames, handle, batch_ids, link, tuple(slots), chunks))
        else:
            self.outgoing.append(_Outgoing(peer, [MESSAGE, encode_header(header), msgpack.packb([])], handle))
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
        if kind == MESSAGE:
            return self.read(link, rest, peer, copy=copy)
        if kind == INLINE and rest:
            header = decode_header(rest[0], peer=peer)
            views = payload_views(header, [memoryview(frame) for frame in rest[1:]], max_bytes=self.max_message_bytes, peer=peer)
            return Message(peer=peer, header=header, tensors=views)
        if kind == CREDIT and len(rest) == 1 and link is not None:
            try:
                credits = [int(slot) for slot in msgpack.unpackb(rest[0])]
            except Exception:
                raise WireError(ErrorCode.MALFORMED, "a credit frame that is not a list of slots", peer=peer) from None
            link.remote_free.extend(credits)
            return None
        if kind == HANDSHAKE and len(rest) == 1:
            self.on_handshake(peer, rest[0])
            return None
        raise WireError(ErrorCode.MALFORMED, f"not a mooncake transport frame (kind {kind[:8]!r}, {len(frames)} frames)", peer=peer or None)

    def close_links(self) -> None:
        self.outgoing.clear()
        for link in self.links.values():
            link.close()
        self.links.clear()
