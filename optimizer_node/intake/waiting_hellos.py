"""HELLOs that wait for rank 0: the other ranks of a job may say HELLO before rank 0 registered it,
and are answered once it has. Anyone who reaches the node can say HELLO, so what waits is bounded:
at most ``max_count`` HELLOs and ``max_bytes`` of them. Each is kept small: its metadata (the job's
layout, most of it) is held as the bytes it was encoded in, and one layout that many ranks send
(they all send the same) is held once.
"""

from __future__ import annotations

import dataclasses

import msgpack

from protos.job.spec import LimitError
from transport.interface import Message

ENTRY_BYTES = 512
"""What one waiting HELLO costs besides its layout (the message, its header, the peer's id): counted
against ``max_bytes`` too, so that many HELLOs of one small layout are bounded by bytes as well."""


@dataclasses.dataclass(slots=True)
class _Waiting:
    message: Message  # the HELLO with its meta taken out
    meta: bytes  # the meta, as msgpack


class WaitingHellos:
    """HELLOs held until the job is registered, in arrival order; one per peer and rank (a peer that
    says HELLO again as the same rank replaces its earlier one)."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._waiting: dict[tuple[bytes, int], _Waiting] = {}
        self._layouts: dict[bytes, int] = {}  # encoded meta -> how many waiting HELLOs share it
        self.held_bytes = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def hold(self, message: Message) -> None:
        """Hold ``message`` (a HELLO without payload); :class:`LimitError` naming the flag to raise
        when it would go over ``max_count`` or ``max_bytes`` (nothing is held then)."""
        meta = msgpack.packb(message.header.meta, use_bin_type=True)
        key = (message.peer, message.header.rank)
        replaced = self._waiting.get(key)
        count = len(self._waiting) + (replaced is None)
        if count > self.max_count:
            raise LimitError(f"{len(self._waiting)} HELLOs already wait for rank 0 to register the job, the most this node holds", "--max-waiting-hellos")
        freed = 0 if replaced is None else self._release_size(replaced.meta)
        shared = self._layouts.get(meta, 0) - (replaced is not None and replaced.meta == meta)  # others holding this layout
        if self.held_bytes - freed + ENTRY_BYTES + (0 if shared else len(meta)) > self.max_bytes:
            raise LimitError(
                f"the HELLOs waiting for rank 0 to register the job hold {self.held_bytes} bytes, this one would take them over {self.max_bytes}",
                "--max-waiting-hello-bytes",
            )
        if replaced is not None:
            self._release(replaced.meta)
            del self._waiting[key]  # the new one goes last: arrival order
        self.held_bytes += ENTRY_BYTES + (0 if meta in self._layouts else len(meta))
        self._layouts[meta] = self._layouts.get(meta, 0) + 1
        bare = dataclasses.replace(message, header=dataclasses.replace(message.header, meta={}), tensors=[])
        self._waiting[key] = _Waiting(bare, meta)

    def take_all(self) -> list[Message]:
        """Every held HELLO, as it arrived, and hold none any more."""
        waiting, self._waiting, self._layouts, self.held_bytes = self._waiting, {}, {}, 0
        return [_restored(entry) for entry in waiting.values()]

    def _release_size(self, meta: bytes) -> int:
        """Bytes freed if one HELLO of layout ``meta`` went away."""
        return ENTRY_BYTES + (len(meta) if self._layouts[meta] == 1 else 0)

    def _release(self, meta: bytes) -> None:
        self.held_bytes -= self._release_size(meta)
        if self._layouts[meta] == 1:
            del self._layouts[meta]
        else:
            self._layouts[meta] -= 1


def _restored(entry: _Waiting) -> Message:
    meta = msgpack.unpackb(entry.meta, raw=False, strict_map_key=False)
    return dataclasses.replace(entry.message, header=dataclasses.replace(entry.message.header, meta=meta))
