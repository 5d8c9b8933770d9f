"""What the ZeroMQ backend's endpoints share: socket settings, sends (tracked where asked), routing
ids of lanes, decoding a frame set, and binding an address only one process may serve."""

from __future__ import annotations

import errno
import logging
import os
import re
import socket as sockets
import stat
import time
from collections.abc import Hashable

import zmq

from transport.interface import Message, SendHandle
from transport.payload_views import payload_views
from transport.shm.same_host import SharedConnection
from transport.wire import DEFAULT_CHUNK_BYTES, ErrorCode, Header, Payload, WireError, decode_header, encode_message

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


class TrackedSend(SendHandle):
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


def send_frames(
    socket: zmq.Socket,
    prefix: list[bytes],
    header: Header,
    payload: Payload | None,
    chunk_bytes: int,
    *,
    track: bool = False,
    shared: SharedConnection | None = None,
    published: tuple[Hashable, Hashable] | None = None,
) -> SendHandle:
    if shared is not None:  # the payload into the peer's window or on the board: only control frames go
        frames = shared.frames(header, payload, chunk_bytes, published)
        if frames is not None:
            return send_small(socket, [*prefix, *frames], track)
    header_frame, *chunks = encode_message(header, payload, chunk_bytes)
    if track:  # every frame, small ones too (pyzmq would copy those and call them done at once)
        return send_small(socket, [*prefix, header_frame, *chunks], True)
    for frame in prefix:
        socket.send(frame, zmq.SNDMORE)
    if not chunks:
        socket.send(header_frame)
        return TrackedSend([])
    socket.send(header_frame, zmq.SNDMORE)
    trackers = []
    for index, chunk in enumerate(chunks):
        flags = zmq.SNDMORE if index + 1 < len(chunks) else 0
        if len(chunk) >= ZERO_COPY_BYTES:
            trackers.append(socket.send(chunk, flags, copy=False, track=True))
        else:
            socket.send(chunk, flags)
    return TrackedSend(trackers)


def send_small(socket: zmq.Socket, frames: list, track: bool) -> SendHandle:
    """Send ``frames``; with ``track``, a handle done once every one of them has left the process."""
    if not track:
        socket.send_multipart(frames)
        return TrackedSend([])
    trackers = []
    for index, frame in enumerate(frames):
        flags = zmq.SNDMORE if index + 1 < len(frames) else 0
        trackers.append(socket.send(zmq.Frame(frame, copy=False, track=True), flags, copy=False, track=True))
    return TrackedSend(trackers)


LANED = b"\x01"  # first byte of a laned client's routing ids (ZeroMQ reserves ids starting with 0)
LANE_ID_BYTES = 8 + 2
SINGLE = b"\x02"  # first byte of a one-lane client's routing id (8 bytes: the node takes it as it is)


def lane_of(header: Header, lanes: int) -> int:
    return header.bucket_id % lanes if header.bucket_id >= 0 else 0


def decode_message(frames: list[zmq.Frame], peer: bytes, max_message_bytes: int) -> Message:
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
