"""A node's parameter board: one copy of the values it sends, read by all its same-host workers.

Without it, a node copies a bucket's new values into the window of every same-host worker that asks
for them, and a layer-wise worker asks twice a step (forward and backward): on a host with eight
workers, eight to sixteen copies of the model a step. With it, the node writes a bucket's values
once per version into a slot of the board, and every worker that mapped the board is sent only the
slot's place, from which it installs (or copies to its device) directly.

The board is a sealed ``memfd`` (:class:`~transport.shm.window.SharedWindow`) sized for the job's
values, sealed against writable mappings once the node has its own (``F_SEAL_FUTURE_WRITE``):
workers map it read-only, so no worker can change what another reads.

A slot starts with a 64-byte header holding the token of the version it holds (0 while being
written) and is followed by the payload. The caller of :meth:`BoardPublisher.reference` promises
that once it publishes a newer version of a key, no peer still reads the older one (a node
publishes a bucket's next values only after every rank pushed the gradients computed from the
previous ones); a reader checks the token once it has copied the values out
(:meth:`BoardReader.read`'s ``current``), so that a broken promise is an error, never torn values.

A board made with two slots a key (``slots_per_key=2``) writes each version computed in place
(:meth:`BoardPublisher.open_slot`) into the key's other slot, so the version before stays intact
beside it, token and all: what a node keeps for a worker that restarts mid-step, without a copy
(:meth:`BoardPublisher.held`).
"""

from __future__ import annotations

import fcntl
import functools
import itertools
import mmap
import os
from collections.abc import Callable, Hashable, Sequence

import msgpack
import torch

from transport.shm.window import MAX_EXTENT_CHUNKS, UNIT_BYTES, SharedWindow, copy_pieces
from transport.wire import ErrorCode, WireError

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1; not named by every Python

SLOT_HEADER_BYTES = 64
"""A slot's token, in a cache line of its own: the payload after it stays 64-byte aligned."""

_tokens = itertools.count(1)  # process-wide: a token never names two versions, even across boards


def slot_bytes(payload_bytes: int) -> int:
    """Room a payload of ``payload_bytes`` takes on a board: its header, and the payload rounded up to
    a cache line."""
    return SLOT_HEADER_BYTES + -(-payload_bytes // SLOT_HEADER_BYTES) * SLOT_HEADER_BYTES


def board_bytes(payload_sizes: Sequence[int]) -> int:
    """A board's size for payloads of ``payload_sizes`` bytes (one slot each), in whole units."""
    total = sum(slot_bytes(n) for n in payload_sizes)
    return max(UNIT_BYTES, -(-total // UNIT_BYTES) * UNIT_BYTES)


class BoardPublisher:
    """The node's side: the board's slots, one per key, and the copies into them."""

    def __init__(self, nbytes: int, name: str, *, slots_per_key: int = 1) -> None:
        if slots_per_key not in (1, 2):
            raise ValueError(f"a board has one or two slots a key, not {slots_per_key}")
        self.window = SharedWindow.create(nbytes, name, extra_seals=F_SEAL_FUTURE_WRITE)
        self.window.advise_huge_pages()  # before the first write allocates its pages: see BoardReader.read
        self._tokens = self.window.bytes.view(torch.int64)  # a slot's token is at its start // 8
        self._slots: dict[Hashable, tuple[int, int, Hashable, int]] = {}  # key -> (start, payload bytes, version, token)
        self._double = slots_per_key == 2
        self._other: dict[Hashable, tuple[int, int, Hashable]] = {}  # key -> its other slot: (start, payload bytes, version held)
        self._end = 0
        self.written_bytes = 0  # payload bytes written in: copied by reference() or in place after open_slot()
        self.copied_bytes = 0  # of them, copied by reference(): values not computed on the board
        self.referenced_bytes = 0  # payload bytes sent as references

    @property
    def name(self) -> str:
        return self.window.name

    def describe(self) -> list:
        """What a worker needs to open the board: ``[pid, fd, name, bytes]``."""
        return [os.getpid(), self.window.fd, self.window.name, self.window.nbytes]

    def reference(self, key: Hashable, version: Hashable, pieces: Sequence[torch.Tensor], lengths: list[int]) -> bytes | None:
        """The place of ``key``'s values of ``version`` on the board, copying ``pieces`` there first if
        the slot holds another version; ``None`` when the board has no room for them (the caller
        sends them another way). ``lengths`` are the chunk lengths of the message, as
        :func:`~transport.shm.window.payload_pieces` cuts them."""
        total = sum(lengths)
        slot = self._slot(key, total)
        if slot is None:
            return None
        start, _total, held, token = slot
        other = self._other.get(key)
        if (held != version or token == 0) and other is not None and other[1] == total and other[2] == version:
            start, token = other[0], int(self._tokens[other[0] // 8])  # the version before, still there
        elif held != version or token == 0:
            start = self._writable(key, total, slot)
            index = start // 8
            self._tokens[index] = 0  # a reader that copies now finds the slot changed under it
            copy_pieces(self.window.bytes, start + SLOT_HEADER_BYTES, pieces)
            token = next(_tokens)
            self._tokens[index] = token
            self.written_bytes += total
            self.copied_bytes += total
            self._slots[key] = (start, total, version, token)
        self.referenced_bytes += total
        return msgpack.packb([start, lengths, token])

    def _writable(self, key: Hashable, nbytes: int, slot: tuple[int, int, Hashable, int]) -> int:
        """Where the next version of ``key`` goes: its slot (``slot``), or with two slots a key the other
        one (made at the board's end if there is room), the current one then becoming the one before."""
        if not self._double:
            return slot[0]
        other = self._other.get(key)
        if (other is None or other[1] != nbytes) and self._end + slot_bytes(nbytes) <= self.window.nbytes:
            other = (self._end, nbytes, None)
            self._end += slot_bytes(nbytes)
        if other is None or other[1] != nbytes:  # no room for a second slot: in place, and nothing before it is kept
            self._other.pop(key, None)
            return slot[0]
        self._other[key] = (slot[0], nbytes, slot[2] if slot[3] else None)
        return other[0]

    def open_slot(self, key: Hashable, nbytes: int) -> torch.Tensor | None:
        """``key``'s slot for ``nbytes`` of payload, as writable bytes for the caller to write the next
        version into in place (the node's update pass writes it as it computes the values), then
        :meth:`written`. Until then the slot holds no version: a reader that copies meanwhile finds
        its token changed. ``None`` when the board has no room."""
        slot = self._slot(key, nbytes)
        if slot is None:
            return None
        start = self._writable(key, nbytes, slot)
        self._tokens[start // 8] = 0
        self._slots[key] = (start, nbytes, None, 0)
        payload = start + SLOT_HEADER_BYTES
        return self.window.bytes[payload : payload + nbytes]

    def held(self, key: Hashable, version: Hashable) -> torch.Tensor | None:
        """With two slots a key: the payload bytes of ``key``'s slot that holds ``version`` (the current
        one, or the one before it), or ``None``. They hold it until :meth:`open_slot` of the key writes
        that slot again: the open after next for the current one, the next for the other."""
        if not self._double:  # one slot a key: the next open_slot writes over it in place
            return None
        slot = self._slots.get(key)
        if slot is not None and slot[2] == version and slot[3]:
            start, nbytes = slot[0], slot[1]
        else:
            other = self._other.get(key)
            if other is None or other[2] != version:
                return None
            start, nbytes = other[0], other[1]
        payload = start + SLOT_HEADER_BYTES
        return self.window.bytes[payload : payload + nbytes]

    def written(self, key: Hashable, version: Hashable) -> None:
        """The slot :meth:`open_slot` gave for ``key`` now holds ``version``."""
        slot = self._slots.get(key)
        if slot is None:
            return
        start, nbytes, _held, _token = slot
        token = next(_tokens)
        self._tokens[start // 8] = token
        self._slots[key] = (start, nbytes, version, token)
        self.written_bytes += nbytes

    def _slot(self, key: Hashable, nbytes: int) -> tuple[int, int, Hashable, int] | None:
        """``key``'s slot, made at the board's end for a new key or one whose size changed (a new
        layout); ``None`` when there is no room."""
        slot = self._slots.get(key)
        if slot is None or slot[1] != nbytes:
            if self._end + slot_bytes(nbytes) > self.window.nbytes:
                return None
            slot = (self._end, nbytes, None, 0)
            self._end += slot_bytes(nbytes)
        return slot

    def close(self) -> None:
        """Close the board; workers' mappings keep its pages until they unmap it."""
        self._tokens = torch.empty(0, dtype=torch.int64)
        self.window.close()


class BoardReader:
    """The worker's side: a read-only mapping of the node's board."""

    def __init__(self, window: SharedWindow) -> None:
        self.window = window
        self.read_bytes = 0

    @classmethod
    def open(cls, description: object) -> BoardReader:
        """The board a node described (:meth:`BoardPublisher.describe`); ``OSError``/``ValueError``
        when it cannot be opened here or is not sealed as a board must be."""
        if not isinstance(description, list) or len(description) != 4:
            raise ValueError(f"a board is described as [pid, fd, name, bytes], not {description!r}")
        pid, fd, name, nbytes = description
        window = SharedWindow.open(int(pid), int(fd), int(nbytes), str(name), writable=False, extra_seals=F_SEAL_FUTURE_WRITE)
        window.advise_huge_pages()
        return cls(window)

    @property
    def name(self) -> str:
        return self.window.name

    def read(self, raw: bytes | memoryview, payload_bytes: int) -> tuple[memoryview, Callable[[], bool], Callable[[], None]]:
        """The payload of a message whose slot reference is ``raw`` (a read-only view of the board); a
        check to call once it was copied out (whether the slot still holds that version); and a
        release that takes the slot's pages out of this process's page tables (not out of memory:
        they are the node's), so that a worker's resident size does not count the node's copy. The
        release does nothing on a board page-locked for a device. The next read of those pages faults
        them in again: in 4 KiB pages, 64 KiB a fault, ~55 ms for 640 MB on one core of the development
        VM; where the host gives shared memory huge pages on advice (both sides advise them), 2 MiB a
        fault, as cheap as pages that stayed mapped. ``WireError`` for a reference
        outside the board or not matching ``payload_bytes``."""
        try:
            start, lengths, token = msgpack.unpackb(raw, max_array_len=MAX_EXTENT_CHUNKS)
            valid = isinstance(start, int) and isinstance(token, int) and isinstance(lengths, list) and all(isinstance(n, int) and n > 0 for n in lengths)
        except Exception:
            valid = False
        if not valid:
            raise WireError(ErrorCode.MALFORMED, "a board message's slot is not [start, [lengths], token]")
        total = sum(lengths)
        data = start + SLOT_HEADER_BYTES
        if total != payload_bytes or start < 0 or start % SLOT_HEADER_BYTES or data + total > self.window.nbytes or token <= 0:
            raise WireError(
                ErrorCode.BAD_PAYLOAD,
                f"a board slot of {total} bytes at {start} is not the declared {payload_bytes} bytes inside the {self.window.nbytes}-byte board",
            )
        whole = self.window.view(data, total)
        token_view = self.window.view(start, 8).cast("q")
        self.read_bytes += total
        first_page, end_page = -(-data // mmap.PAGESIZE) * mmap.PAGESIZE, (data + total) // mmap.PAGESIZE * mmap.PAGESIZE  # whole pages of the slot only

        def release() -> None:
            if end_page > first_page and not self.window.page_locked:
                self.window.drop_pages(first_page, end_page - first_page)

        return whole, lambda: token_view[0] == token, release

    def close(self) -> None:
        self.window.close()


@functools.cache
def seals_supported() -> bool:
    """Whether this kernel seals a memory file against new writable mappings (Linux 5.1 and later)."""
    try:
        fd = os.memfd_create("netoptim-seal-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


__all__ = ["BoardPublisher", "BoardReader", "board_bytes", "seals_supported", "slot_bytes"]
