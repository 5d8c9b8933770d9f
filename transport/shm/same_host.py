"""The shared-memory payload path of a node's same-host socket (:mod:`transport.shm.window`).

On the node's ``ipc://`` socket, a frame set whose first frame is one byte long is a control frame of
this path; anything else is an ordinary message (:mod:`transport.wire`), so either side may always
fall back to sending payloads on the socket:

- ``H`` handshake. The worker asks (``{"pid": ..., "board": true, "locks": ...}``: it reads parameter
  boards; whether it may page-lock windows for a GPU, in which case the node never gives back pages
  of the window it writes into);
  the node makes the connection's two windows and answers with its pid and their descriptors and
  sizes (the worker's window for what it sends may be larger: a whole step of its gradients), or
  why not; the worker maps them and says whether it could (``{"mapped": ...}``); either side may
  close (``{"closed": ...}``).
- ``M`` a message whose payload is in the receiver's window: ``[M, header, extent]``.
- ``C`` credits: extents of the sender's window that the receiver no longer reads.
- ``B`` a message whose payload is on the node's parameter board (:mod:`transport.shm.board`):
  ``[B, header, slot]``. The node offers its board in a handshake frame (``{"board": ...}``) to
  each worker whose windows are mapped and that said it reads boards, and uses it for a worker once
  it answered that it mapped it (``{"board_mapped": name}``).

The node writes into a worker's window only once the worker said it mapped it, opens nothing a
client names, and forgets a worker's windows when it closes them, when its process exits (a pidfd
tells) or when the peer is forgotten; it keeps at most ``max_peers`` pairs.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import msgpack
import torch

from transport.shm.board import BoardPublisher, BoardReader, seals_supported
from transport.shm.window import MIN_SHARED_BYTES, UNIT_BYTES, SharedWindow, WindowReader, WindowWriter, parse_credits, payload_pieces
from transport.wire import ErrorCode, Header, Payload, WireError, encode_header

log = logging.getLogger(__name__)

HANDSHAKE, SHARED, CREDIT, BOARD = b"H", b"M", b"C", b"B"
CONTROL_KINDS = (HANDSHAKE, SHARED, CREDIT, BOARD)

DEFAULT_WINDOW_BYTES = 64 << 20
"""Each direction of a same-host connection: room for the payloads in flight. Pages are allocated
as they are first written and then kept while the connection lasts: a window's resident part is the
most that was ever in flight in it (what the socket path would have held in its buffers meanwhile)."""

DEFAULT_MAX_PEERS = 64
"""Same-host connections a node gives windows to at once; later ones send on the socket."""


def is_control(frame: bytes | memoryview) -> bool:
    """Whether a frame set starting with ``frame`` belongs to the shared-memory path (a header is a
    msgpack map, never one byte long)."""
    return len(frame) == 1 and bytes(frame) in CONTROL_KINDS


def _decode_handshake(raw: bytes | memoryview, peer: bytes | None) -> dict:
    try:
        info = msgpack.unpackb(raw, max_map_len=16, max_array_len=16)
    except Exception:
        info = None
    if not isinstance(info, dict):
        raise WireError(ErrorCode.MALFORMED, "a shared-memory handshake is not a map", peer=peer)
    return info


@dataclass
class SharedConnection:
    """One connection's two windows: ``reader`` over the one the peer writes into, ``writer`` over
    the one this side writes into (usable once ``ready``)."""

    reader: WindowReader
    writer: WindowWriter
    ready: bool = False
    pidfd: int = -1
    board: BoardPublisher | None = None  # the node's board, once the peer mapped it
    board_offered: str | None = None  # the board offered to the peer and not answered yet
    takes_board: bool = False  # the peer said, when it asked for windows, that it reads boards

    def frames(self, header: Header, payload: Payload | None, chunk_bytes: int, published: tuple[Hashable, Hashable] | None = None) -> list[bytes] | None:
        """The control frames of a message whose payload went into the peer's window, or is on the
        board (``published``: its key and version, see :meth:`BoardPublisher.reference`), or
        ``None`` when it goes on the socket (no payload worth it, not ready, no room)."""
        if not self.ready or payload is None:
            return None
        pieces, lengths = payload_pieces(payload, chunk_bytes)  # checked as the socket path would
        if len(lengths) != header.num_chunks:
            raise ValueError(f"header declares {header.num_chunks} chunks, payload has {len(lengths)}")
        if sum(lengths) < MIN_SHARED_BYTES:
            return None
        if published is not None and self.board is not None:
            slot = self.board.reference(published[0], published[1], pieces, lengths)
            if slot is not None:
                return [BOARD, encode_header(header), slot]
        extent = self.writer.placed(pieces, lengths) or self.writer.write_pieces(pieces, lengths)  # in place already, or copied in
        return None if extent is None else [SHARED, encode_header(header), extent]

    def read(self, header: Header, extent: bytes | memoryview, peer: bytes | None) -> list[memoryview]:
        return self.reader.read(extent, header.payload_bytes, peer)

    def close(self) -> None:
        self.reader.window.close()
        self.writer.window.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class SharedPeers:
    """The node side: the windows of each same-host peer that asked for them."""

    def __init__(
        self, watch: Callable[[int], None], unwatch: Callable[[int], None], window_bytes: int = DEFAULT_WINDOW_BYTES, max_peers: int = DEFAULT_MAX_PEERS
    ) -> None:
        """``watch``/``unwatch`` add a worker's pidfd to the caller's poller and take it out (before
        it is closed): a readable pidfd goes to :meth:`exited`."""
        self._watch, self._unwatch = watch, unwatch
        self.window_bytes = window_bytes
        # What a worker's window for its gradients holds (:meth:`size_inboxes`); the other way, window_bytes.
        self.inbox_bytes = window_bytes
        self.max_peers = max_peers
        self.connections: dict[bytes, SharedConnection] = {}
        self._by_pidfd: dict[int, bytes] = {}
        self._written_before = 0  # by connections since closed
        self._read_before = 0
        self.board: BoardPublisher | None = None
        self._board_bytes_before = {"board_written_bytes": 0, "board_copied_bytes": 0, "board_referenced_bytes": 0}  # by boards since closed

    def snapshot(self) -> dict[str, int]:
        """Windowed connections and payload bytes through them each way (``written_bytes`` counts
        board references too); the board's size, the bytes written onto it (in place or copied), those
        copied and those sent as references to it. Safe from another thread (values are copied under the interpreter lock)."""
        live = list(self.connections.values())
        board = self.board
        board_counts = {
            key: before + (getattr(board, key.removeprefix("board_")) if board is not None else 0) for key, before in self._board_bytes_before.items()
        }
        return {
            "connections": len(live),
            "written_bytes": self._written_before + sum(c.writer.written_bytes for c in live) + board_counts["board_referenced_bytes"],
            "read_bytes": self._read_before + sum(c.reader.read_bytes for c in live),
            "board_bytes": board.window.nbytes if board is not None else 0,
            **board_counts,  # written (in place or copied), copied, referenced: those of the boards since closed too
        }

    def publish_board(self, nbytes: int, name: str, *, slots_per_key: int = 1) -> list[tuple[bytes, bytes]]:
        """Make a board of ``nbytes`` (replacing any), to be offered to every windowed peer: the
        ``(peer, body)`` handshake frames that offer it to those ready now. No board (and no frames)
        where this kernel cannot seal one against writers."""
        self.drop_board()
        if not seals_supported():
            log.info("no parameter board: this kernel cannot seal memory files against writers (Linux 5.1 or later can)")
            return []
        try:
            self.board = BoardPublisher(nbytes, name, slots_per_key=slots_per_key)
        except OSError as exc:
            log.warning("no parameter board of %d bytes: %s; same-host workers get their own copies", nbytes, exc)
            return []
        return [(peer, self._board_offer(connection)) for peer, connection in self.connections.items() if connection.ready and connection.takes_board]

    def _board_offer(self, connection: SharedConnection) -> bytes:
        assert self.board is not None
        connection.board_offered = self.board.name
        return msgpack.packb({"board": self.board.describe()})

    def board_slot(self, key: Hashable, nbytes: int) -> torch.Tensor | None:
        """Writable bytes of ``key``'s slot on the board (:meth:`BoardPublisher.open_slot`), where a peer
        reads from the board and the payload is one the board would carry; else ``None``."""
        if self.board is None or nbytes < MIN_SHARED_BYTES or not any(connection.board is not None for connection in self.connections.values()):
            return None
        return self.board.open_slot(key, nbytes)

    def board_written(self, key: Hashable, version: Hashable) -> None:
        """The slot :meth:`board_slot` gave now holds ``version``."""
        if self.board is not None:
            self.board.written(key, version)

    def drop_board(self) -> None:
        """Stop using the board and close it (workers keep their mappings until they drop them)."""
        if self.board is None:
            return
        for connection in self.connections.values():
            connection.board = connection.board_offered = None
        for key in self._board_bytes_before:
            self._board_bytes_before[key] += getattr(self.board, key.removeprefix("board_"))
        self.board.close()
        self.board = None

    def size_inboxes(self, nbytes: int) -> None:
        """Windows made from now on for what workers send here hold ``nbytes`` more than the window size
        each way (in whole units): room for a whole step of a worker's gradients, gathered straight
        into it, with the window's worth to spare for the extents whose credits are still on their way
        when the next step's gradients come (a worker reads them at its next receive). 0: the window
        size again."""
        units = -(-max(nbytes, 0) // UNIT_BYTES)
        self.inbox_bytes = self.window_bytes + units * UNIT_BYTES if self.window_bytes > 0 else 0

    def handshake(self, peer: bytes, raw: bytes | memoryview) -> bytes | None:
        """Handle a worker's handshake; the body of the answer to send it, if any."""
        info = _decode_handshake(raw, peer)
        if "pid" in info:
            answer = self._open(peer, info["pid"])
            connection = self.connections.get(peer)
            if connection is not None:
                connection.takes_board = info.get("board") is True
                connection.writer.keep_resident = info.get("locks") is not False  # unsaid: it may
            return msgpack.packb(answer)
        if "mapped" in info:
            connection = self.connections.get(peer)
            if connection is not None and info["mapped"] is True:
                connection.ready = True
                log.debug("peer %s reads its payloads from shared memory", peer.hex())
                return self._board_offer(connection) if self.board is not None and connection.takes_board else None
            elif connection is not None:  # logged once per pair of windows made, not once per message
                self.forget(peer)
                log.info("a same-host worker could not map its windows (%s); its payloads go on the socket", str(info.get("why", "?"))[:200])
            return None
        if "board_mapped" in info:
            connection = self.connections.get(peer)
            if connection is None or self.board is None or connection.board_offered != self.board.name:
                return None  # only the answer to the board offered now counts, once
            connection.board_offered = None
            if info["board_mapped"] == self.board.name:
                connection.board = self.board
            else:
                log.info("a same-host worker could not map the parameter board (%s): it gets its own copies", str(info.get("why", "?"))[:200])
            return None
        if info.get("closed"):
            self.forget(peer)
            return None
        raise WireError(ErrorCode.MALFORMED, "a shared-memory handshake says nothing this node knows", peer=peer)

    def _open(self, peer: bytes, pid: object) -> dict:
        self.forget(peer)
        if self.window_bytes <= 0:
            return {"refused": "this node keeps same-host payloads on the socket (--same-host-window-mb 0)"}
        if len(self.connections) >= self.max_peers:
            return {"refused": f"this node gives shared windows to {self.max_peers} same-host connections at most"}
        if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 1 << 31:  # a pid is a C int
            return {"refused": "no valid pid in the handshake"}
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            return {"refused": f"process {pid} is not visible from the node ({exc.strerror}): another pid namespace?"}
        token = secrets.token_hex(8)
        try:
            inbox = SharedWindow.create(self.inbox_bytes, f"netoptim-{token}-in")
            outbox = SharedWindow.create(self.window_bytes, f"netoptim-{token}-out")
        except OSError as exc:
            os.close(pidfd)
            return {"refused": f"the node could not make shared windows ({exc})"}
        connection = SharedConnection(WindowReader(inbox), WindowWriter(outbox), pidfd=pidfd)
        self.connections[peer] = connection
        self._by_pidfd[pidfd] = peer
        self._watch(pidfd)
        describe = {"pid": os.getpid(), "bytes": self.window_bytes, "write_bytes": self.inbox_bytes}
        # Named from the worker's side: it writes into what the node reads.
        return describe | {"write": [inbox.fd, inbox.name], "read": [outbox.fd, outbox.name]}

    def exited(self, pidfd: int) -> None:
        """The process behind ``pidfd`` is gone: its windows go with it."""
        peer = self._by_pidfd.get(pidfd)
        if peer is not None:
            log.debug("same-host peer %s exited; its windows are freed", peer.hex())
            self.forget(peer)

    def forget(self, peer: bytes) -> None:
        connection = self.connections.pop(peer, None)
        if connection is not None:
            if self._by_pidfd.pop(connection.pidfd, None) is not None:
                self._unwatch(connection.pidfd)
            self._written_before += connection.writer.written_bytes
            self._read_before += connection.reader.read_bytes
            connection.close()

    def credits(self) -> list[tuple[bytes, bytes]]:
        """``(peer, body)`` of the credit frames due."""
        due = []
        for peer, connection in self.connections.items():
            body = connection.reader.take_credits()
            if body is not None:
                due.append((peer, body))
        return due

    def close(self) -> None:
        for peer in list(self.connections):
            self.forget(peer)
        self.drop_board()


class SharedClient:
    """The worker side of one same-host connection's shared-memory path."""

    def __init__(self) -> None:
        self.connection: SharedConnection | None = None
        self.board: BoardReader | None = None
        self.refused: str | None = None

    @staticmethod
    def request() -> list[bytes]:
        # "locks": this process may page-lock the windows for a GPU's copies, so the node must never give
        # pages of its window back (the device would go on using the old ones)
        return [HANDSHAKE, msgpack.packb({"pid": os.getpid(), "board": True, "locks": torch.cuda.is_available()})]

    def answer(self, raw: bytes | memoryview) -> list[bytes] | None:
        """Handle the node's handshake answer; the frames to send back, if any."""
        info = _decode_handshake(raw, None)
        if "board" in info:
            return self._open_board(info["board"])
        if "refused" in info:
            self.refused = str(info["refused"])[:200]
            log.info("payloads to this node go on the socket: %s", self.refused)
            return None
        try:
            pid, nbytes = int(info["pid"]), int(info["bytes"])
            write_bytes = int(info.get("write_bytes", nbytes))
            (write_fd, write_name), (read_fd, read_name) = info["write"], info["read"]
            outbox = SharedWindow.open(pid, write_fd, write_bytes, str(write_name))
        except (KeyError, TypeError, ValueError, OSError) as exc:
            return self._unmapped(exc)
        try:
            inbox = SharedWindow.open(pid, read_fd, nbytes, str(read_name))
        except (TypeError, ValueError, OSError) as exc:
            outbox.close()
            return self._unmapped(exc)
        self.close()
        self.connection = SharedConnection(WindowReader(inbox), WindowWriter(outbox), ready=True)
        return [HANDSHAKE, msgpack.packb({"mapped": True})]

    def _open_board(self, description: object) -> list[bytes] | None:
        if self.connection is None:  # offered only to a worker whose windows are mapped
            return None
        try:
            board = BoardReader.open(description)
        except (TypeError, ValueError, OSError) as exc:
            why = f"the node's parameter board could not be mapped here ({exc})"[:200]
            log.info("parameters from this node come through this worker's window: %s", why)
            return [HANDSHAKE, msgpack.packb({"board_mapped": False, "why": why})]
        if self.board is not None:
            self.board.close()
        self.board = board
        return [HANDSHAKE, msgpack.packb({"board_mapped": board.name})]

    def _unmapped(self, exc: BaseException) -> list[bytes]:
        self.refused = f"the node's windows could not be mapped here ({exc})"[:200]
        log.info("payloads to this node go on the socket: %s", self.refused)
        return [HANDSHAKE, msgpack.packb({"mapped": False, "why": self.refused})]

    def reserve(self, nbytes: int) -> torch.Tensor | None:
        """Bytes of the node's window for the caller to fill in place and then send (see
        :meth:`WindowWriter.reserve`), or ``None`` (no windows, no room, too small)."""
        return self.connection.writer.reserve(nbytes) if self.connection is not None else None

    def cancel(self, reserved: torch.Tensor) -> None:
        """Bytes :meth:`reserve` gave that will not be sent."""
        if self.connection is not None:
            self.connection.writer.cancel(reserved)

    def credit(self, raw: bytes | memoryview) -> None:
        if self.connection is not None:
            self.connection.writer.credit(parse_credits(raw, None))

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None
        if self.board is not None:
            self.board.close()
            self.board = None
