"""Shared-memory windows: how a node and a worker on one host pass payloads without the kernel.

A :class:`SharedWindow` is an anonymous memory file (``memfd``) sealed at its size and mapped by both
processes. The node makes the two windows of a connection (one each way) and names them in its
handshake; the worker opens them through ``/proc/<node pid>/fd/<fd>``. The seals mean no process can
shrink a window under a mapping (which would kill the reader with ``SIGBUS``), and the node never
opens a file a client names.

A sender copies a payload into a free extent of the peer's window (:class:`WindowWriter`) and sends
only the header and the extent's place on the socket; the receiver views its window there without a
copy (:class:`WindowReader`) and gives the extent back, as a credit, once the last view of it is
gone. A sender that finds no room sends the payload on the socket as usual, so a slow reader costs
a copy, never a wait.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import fcntl
import mmap
import os
import time
import warnings
import weakref
from collections.abc import Callable, Sequence

import msgpack
import torch

from transport.host_memory import kernel_choice
from transport.wire import ErrorCode, Payload, WireError

UNIT_BYTES = 4 << 10
"""Extents are whole pages: a multiple of every wire dtype and of a cache line."""

MIN_SHARED_BYTES = 4 << 10
"""Smaller payloads go on the socket (most small buckets travel in batches anyway)."""

TRIM_PERIOD_S = 10.0
"""A writer gives back, once a period, the pages above what the period used (a burst's high-water
mark); what every step uses stays resident, so steady traffic never faults pages in again."""

TRIM_MIN_BYTES = 4 << 20
"""Less than this above the period's use is left resident."""

MAX_EXTENT_CHUNKS = 1 << 16
"""Chunk lengths one message may list (a 2 GiB payload in 4 MiB chunks lists 512)."""

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

_OPEN_WINDOWS: weakref.WeakSet[SharedWindow] = weakref.WeakSet()


SHMEM_HUGE_PAGES = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
SHMEM_HUGE_ON_ADVICE = frozenset({"advise", "always", "within_size", "force"})
"""Policies under which a mapping that advises huge pages (:meth:`SharedWindow.advise_huge_pages`) gets them."""


def shared_huge_pages() -> str | None:
    """The host's policy for transparent huge pages in shared memory (``never``, ``advise``,
    ``always``, ``within_size``, ...), as the kernel reports it; ``None`` where it does not."""
    return kernel_choice(SHMEM_HUGE_PAGES)


def shared_pages_said() -> str:
    """Which pages a window that advises huge ones gets on this host, and where they are 4 KiB, how
    to change that: for a node's log."""
    policy = shared_huge_pages()
    if policy in SHMEM_HUGE_ON_ADVICE:
        return "2 MiB pages"
    if policy is None:
        return "4 KiB pages (this kernel has no transparent huge pages)"
    return f"4 KiB pages (shared memory's huge pages are '{policy}' in {SHMEM_HUGE_PAGES}: 'advise' spares workers most of their page faults on it)"


def window_holding(address: int, nbytes: int) -> SharedWindow | None:
    """The open window of this process that holds ``nbytes`` from ``address``, if one does (how a
    device copy learns that its source is a window it may page-lock once and read directly)."""
    for window in list(_OPEN_WINDOWS):
        base = window.address
        if base <= address and address + nbytes <= base + window.nbytes:
            return window
    return None


class SharedWindow:
    """One sealed ``memfd`` mapped into this process. The mapping lives as long as any view of it:
    closing drops this object's hold, and the memory goes once no view is left."""

    def __init__(self, fd: int, nbytes: int, name: str, *, writable: bool = True) -> None:
        self.fd = fd
        self.nbytes = nbytes
        self.name = name
        self.writable = writable
        prot = mmap.PROT_READ | mmap.PROT_WRITE if writable else mmap.PROT_READ
        self._map: mmap.mmap | None = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
        if writable:
            self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        else:  # torch warns of read-only buffers; nothing here writes through this view
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = self.bytes.data_ptr()
        self.before_close: list[Callable[[], None]] = []  # e.g. a device's page-lock, undone first
        self.page_locked: bool | None = None  # for a device's copies: not asked yet, done, refused
        _OPEN_WINDOWS.add(self)

    @classmethod
    def create(cls, nbytes: int, name: str, *, extra_seals: int = 0) -> SharedWindow:
        """A new window of ``nbytes`` (a whole number of units), sealed at that size; ``extra_seals``
        are added once this process has mapped it (``F_SEAL_FUTURE_WRITE``: no other mapping may write)."""
        if nbytes <= 0 or nbytes % UNIT_BYTES:
            raise ValueError(f"a shared window is a positive multiple of {UNIT_BYTES} bytes, not {nbytes}")
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            window = cls(fd, nbytes, name)
        except BaseException:
            os.close(fd)
            raise
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, extra_seals | fcntl.F_SEAL_SEAL)
        except BaseException:
            window.close()
            raise
        return window

    @classmethod
    def open(cls, pid: int, fd: int, nbytes: int, name: str, *, writable: bool = True, extra_seals: int = 0) -> SharedWindow:
        """The window ``name`` that process ``pid`` holds as ``fd``; ``OSError`` when that is not a
        memory file of that name and size sealed with ``extra_seals`` too (another pid namespace, or
        another process). ``writable=False`` maps it read-only."""
        path = f"/proc/{int(pid)}/fd/{int(fd)}"
        if os.readlink(path) != f"/memfd:{name} (deleted)":
            raise OSError(f"{path} is not the window {name} (is the node in another pid namespace?)")
        own = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
        try:
            seals = _SEALS | extra_seals
            if fcntl.fcntl(own, fcntl.F_GET_SEALS) & seals != seals or os.fstat(own).st_size != nbytes:
                raise OSError(f"{path} is not sealed at {nbytes} bytes")
            return cls(own, nbytes, name, writable=writable)
        except BaseException:
            os.close(own)
            raise

    def give_back(self, offset: int, nbytes: int) -> None:
        """Free the pages of ``nbytes`` from ``offset`` (whole pages, not in use by anyone) in every
        process that maps the window; they read as zeros until written again."""
        assert self._map is not None and offset % mmap.PAGESIZE == 0, "whole pages of an open window"
        self._map.madvise(mmap.MADV_REMOVE, offset, nbytes)

    def advise_huge_pages(self) -> bool:
        """Ask for this mapping to be backed and mapped in 2 MiB pages (``MADV_HUGEPAGE``); whether the
        kernel took the advice. It holds only where the host lets shared memory have transparent huge
        pages on advice (:func:`shared_huge_pages`): then a page fault maps 2 MiB, not 64 KiB."""
        if self._map is None or not hasattr(mmap, "MADV_HUGEPAGE"):
            return False
        try:
            self._map.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages
            return False
        return True

    def drop_pages(self, offset: int, nbytes: int) -> None:
        """Take whole pages out of this process's page tables only (``MADV_DONTNEED``): they stay in
        the file, and the next read maps them again."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED, offset, nbytes)

    def region(self, offset: int, nbytes: int) -> ctypes.Array:
        """``nbytes`` of the window from ``offset``, as an object that keeps the mapping alive."""
        assert self._map is not None, "a closed window is not read"
        return (ctypes.c_char * nbytes).from_buffer(self._map, offset)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """``nbytes`` of the window from ``offset``, as a byte view that keeps the mapping alive (read-only
        where the window is)."""
        assert self._map is not None, "a closed window is not read"
        return memoryview(self._map)[offset : offset + nbytes]

    def close(self) -> None:
        """Close the file and drop this object's views; idempotent."""
        if self._map is not None:
            _OPEN_WINDOWS.discard(self)
            for undo in self.before_close:
                undo()
            self.before_close.clear()
            os.close(self.fd)
            self._map = None
            self.bytes = torch.empty(0, dtype=torch.uint8)


def payload_pieces(payload: Payload, chunk_bytes: int) -> tuple[list[torch.Tensor], list[int]]:
    """The tensors of ``payload`` and the byte lengths of the chunks :func:`transport.wire.payload_chunks`
    cuts them into, worked out without viewing them; ``ValueError`` for a piece the socket path would
    refuse too (not a contiguous 1-D CPU tensor)."""
    pieces = [payload] if isinstance(payload, torch.Tensor) else list(payload)
    lengths = []
    for piece in pieces:
        if piece.dim() != 1 or not piece.is_contiguous() or piece.device.type != "cpu":
            raise ValueError("only contiguous 1-D CPU tensors can be sent")
        nbytes = piece.numel() * piece.element_size()
        lengths.extend([chunk_bytes] * (nbytes // chunk_bytes) + ([nbytes % chunk_bytes] if nbytes % chunk_bytes else []))
    return pieces, lengths


def copy_pieces(target: torch.Tensor, position: int, pieces: Sequence[torch.Tensor]) -> None:
    """Copy ``pieces`` back to back into the bytes ``target`` (a window's) from ``position``: a copy
    between views of one dtype, which torch spreads over cores when large."""
    for piece in pieces:
        nbytes = piece.numel() * piece.element_size()
        target[position : position + nbytes].view(piece.dtype).copy_(piece)
        position += nbytes


class WindowWriter:
    """The sender's side of the peer's window: which extents are free, and the copies into them."""

    def __init__(self, window: SharedWindow, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self._free: list[tuple[int, int]] = [(0, window.nbytes)]  # (start, length), sorted, coalesced
        self._lent: dict[int, int] = {}  # start -> length, extents the peer holds
        self._reserved: dict[int, int] = {}  # start -> bytes, extents a caller fills in place, not sent yet
        self.written_bytes = 0
        self.given_back_bytes = 0
        self._clock = clock
        self._resident_end = 0  # pages below were written since they were last given back
        self._period_end = 0  # the highest end written this period
        self._period_started = clock()
        # Pages a device has page-locked must stay: giving them back would leave the device's copies on
        # the old pages while both processes map new ones. Set where the peer may lock the window; a
        # window locked in this process (its page_locked) keeps its pages whatever this says.
        self.keep_resident = False

    @property
    def lent_bytes(self) -> int:
        return sum(self._lent.values())

    def _take(self, nbytes: int) -> int | None:
        need = -(-nbytes // UNIT_BYTES) * UNIT_BYTES
        for index, (start, length) in enumerate(self._free):  # first fit: low addresses stay warm
            if length >= need:
                if length == need:
                    del self._free[index]
                else:
                    self._free[index] = (start + need, length - need)
                self._lent[start] = need
                self._resident_end = max(self._resident_end, start + need)
                self._period_end = max(self._period_end, start + need)
                return start
        return None

    def write(self, payload: Payload, chunk_bytes: int) -> bytes | None:
        """Copy ``payload`` into a free extent and return its description for the peer, or ``None``
        when the window has no room for it (the caller sends it on the socket instead)."""
        pieces, lengths = payload_pieces(payload, chunk_bytes)
        return self.write_pieces(pieces, lengths)

    def write_pieces(self, pieces: Sequence[torch.Tensor], lengths: list[int]) -> bytes | None:
        """:meth:`write` of pieces already checked and cut (:func:`payload_pieces`)."""
        total = sum(lengths)
        start = self._take(total)
        if start is None:
            return None
        copy_pieces(self.window.bytes, start, pieces)
        self.written_bytes += total
        return msgpack.packb([start, lengths])

    def reserve(self, nbytes: int) -> torch.Tensor | None:
        """``nbytes`` of a free extent for the caller to fill in place (a gradient gathered straight into
        the peer's window, with no copy at send time), or ``None`` when the window has no room or the
        payload is too small to go through it. The extent goes to the peer when a payload that is
        exactly these bytes is sent (:meth:`placed`), or comes back with :meth:`cancel`."""
        if nbytes < MIN_SHARED_BYTES:
            return None
        start = self._take(nbytes)
        if start is None:
            return None
        self._reserved[start] = nbytes
        return self.window.bytes[start : start + nbytes]

    def placed(self, pieces: Sequence[torch.Tensor], lengths: list[int]) -> bytes | None:
        """The description for the peer of a payload that is exactly an extent :meth:`reserve` gave (so
        nothing is copied), or ``None`` for any other payload."""
        if len(pieces) != 1 or not self._reserved:
            return None
        start = pieces[0].data_ptr() - self.window.address
        total = sum(lengths)
        if self._reserved.get(start) != total:
            return None
        del self._reserved[start]
        self.written_bytes += total
        return msgpack.packb([start, lengths])

    def cancel(self, reserved: torch.Tensor) -> None:
        """A reserved extent that will not be sent is free again; anything else is ignored."""
        start = reserved.data_ptr() - self.window.address
        if self._reserved.pop(start, None) is not None:
            self.credit([start])  # now unreserved: freed as a credit would

    @property
    def reserved_bytes(self) -> int:
        """Bytes reserved and not sent yet."""
        return sum(self._reserved.values())

    def credit(self, starts: Sequence[int]) -> None:
        """The peer is done with the extents starting at ``starts``; unknown ones are ignored (a
        peer cannot free what it was not lent)."""
        for start in starts:
            if not isinstance(start, int) or start in self._reserved:  # a reserved extent was not sent: not the peer's to free
                continue
            length = self._lent.pop(start, None)
            if length is None:
                continue
            index = bisect.bisect(self._free, (start, 0))
            self._free.insert(index, (start, length))
            if index + 1 < len(self._free) and start + length == self._free[index + 1][0]:  # join the next
                self._free[index] = (start, length + self._free.pop(index + 1)[1])
            if index > 0 and self._free[index - 1][0] + self._free[index - 1][1] == start:  # join the previous
                previous = self._free.pop(index - 1)
                self._free[index - 1] = (previous[0], previous[1] + self._free[index - 1][1])
        self._trim()

    def _trim(self) -> None:
        """Once a period, give back the resident pages above both this period's use and every
        extent lent now: all free (extents are taken lowest address first, so steady use stays low)."""
        now = self._clock()
        if now - self._period_started < TRIM_PERIOD_S or self.keep_resident or self.window.page_locked:
            return
        lent_end = max((start + length for start, length in self._lent.items()), default=0)
        keep = -(-max(self._period_end, lent_end) // mmap.PAGESIZE) * mmap.PAGESIZE
        if self._resident_end - keep >= TRIM_MIN_BYTES:
            self.window.give_back(keep, self._resident_end - keep)
            self.given_back_bytes += self._resident_end - keep
            self._resident_end = keep
        self._period_end, self._period_started = lent_end, now


class WindowReader:
    """The receiver's side of its own window: views of what the peer wrote, and the credits of the
    extents whose views are all gone."""

    def __init__(self, window: SharedWindow) -> None:
        self.window = window
        self._released: collections.deque[int] = collections.deque()
        self.outstanding = 0
        self.read_bytes = 0

    def read(self, raw: bytes | memoryview, payload_bytes: int, peer: bytes | None) -> list[memoryview]:
        """The chunks of a message whose extent description is ``raw``: views of the window that
        give the extent back when the last of them goes. ``WireError`` for a description outside the
        window or not matching ``payload_bytes``."""
        try:
            start, lengths = msgpack.unpackb(raw, max_array_len=MAX_EXTENT_CHUNKS)
            valid = isinstance(start, int) and isinstance(lengths, list) and all(isinstance(n, int) and n > 0 for n in lengths)
        except Exception:
            valid = False
        if not valid:
            raise WireError(ErrorCode.MALFORMED, "a shared-memory message's extent is not [start, [lengths]]", peer=peer)
        total = sum(lengths)
        if total != payload_bytes or start < 0 or start % UNIT_BYTES or start + total > self.window.nbytes:
            raise WireError(
                ErrorCode.BAD_PAYLOAD,
                f"an extent of {total} bytes at {start} is not the declared {payload_bytes} bytes inside the {self.window.nbytes}-byte window",
                peer=peer,
            )
        region = self.window.region(start, total)
        self.outstanding += 1
        self.read_bytes += total
        weakref.finalize(region, self._released.append, start)  # deque.append is atomic: any thread may drop the last view
        whole = memoryview(region).cast("B")
        chunks, position = [], 0
        for length in lengths:
            chunks.append(whole[position : position + length])
            position += length
        return chunks

    def take_credits(self) -> bytes | None:
        """The extents given back since the last call, as a credit frame's body (``None``: none)."""
        if not self._released:
            return None
        starts = []
        while self._released:
            starts.append(self._released.popleft())
        self.outstanding -= len(starts)
        return msgpack.packb(starts)


def parse_credits(raw: bytes | memoryview, peer: bytes | None) -> list[int]:
    try:
        starts = msgpack.unpackb(raw, max_array_len=MAX_EXTENT_CHUNKS)
    except Exception:
        starts = None
    if not isinstance(starts, list):
        raise WireError(ErrorCode.MALFORMED, "a credit frame is not a list of extents", peer=peer)
    return starts
