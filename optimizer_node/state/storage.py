r"""Where a node keeps the fp32 master parameters and AdamW state of the buckets it owns.

``InMemoryStore`` keeps everything resident in host memory; ``optimizer_node.state.ooc_store`` keeps it in
files under a memory budget. The daemon only talks to the :class:`BucketStore` interface: it
``acquire``\ s a bucket before it reads or writes its tensors and ``release``\ s it after, and it
tells the store which buckets it will need soon (``prefetch``).
"""

from __future__ import annotations

import hashlib
import itertools
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from optimizer_node.moments.codec import SIGNED, MomentCodec, moment_bytes
from transport.interface import SendHandle


class StorageError(Exception):
    """The store cannot read or write a bucket's state (disk full, a damaged or changed state file);
    the message says which bucket and what to do. The bucket's state in memory is unchanged."""


_revisions = itertools.count(1)


@dataclass(slots=True)
class BucketState:
    """The master copy and optimizer state of one bucket. ``step`` counts applied updates."""

    bucket_id: int
    param: torch.Tensor  # (numel,) fp32 master parameters; out of core: valid only while acquired
    exp_avg: torch.Tensor  # (numel,) fp32; with a codec its encoded bytes (uint8)
    exp_avg_sq: torch.Tensor  # (numel,) fp32; with a codec its encoded bytes (uint8)
    step_tensor: torch.Tensor  # () fp32, as torch's AdamW keeps it
    step: int = 0
    # (numel,) fp32 reduction buffer, made on first need: gradients that arrive as one fp32 frame
    # are summed in the frame itself and never need it.
    grad: torch.Tensor | None = None
    # Zero-copy sends still reading ``param`` (or the wire copy); waited for before the next update.
    pending_sends: list[SendHandle] = field(default_factory=list)
    wire_copy: torch.Tensor | None = None  # reused cast buffer when the wire dtype is not fp32
    wire_step: int = -1  # the step whose parameters wire_copy holds (the update pass casts them); -1: none
    numel: int = -1  # set from param at creation; known while the tensors are on disk
    # Which values ``param`` holds at ``step``: a new one whenever they are replaced other than by an
    # update (created, loaded); what the parameter board tells versions apart by, with the step.
    revision: int = field(default_factory=lambda: next(_revisions))
    # AdamW's step count per segment (parameter piece), once the segments' counts differ (a parameter
    # with no gradient on any rank is not stepped, as in torch); None: every segment at ``step_tensor``.
    segment_steps: list[float] | None = None
    # numpy views of param, exp_avg, exp_avg_sq and step_tensor for the compiled update, with the
    # tensors they view: made once (a view each call cost ~3 us a bucket), remade when one is replaced
    _arrays: tuple | None = field(default=None, repr=False, compare=False)
    # ``param`` is a slot of the parameter board (fp32 in memory: the update pass writes each version
    # into the slot beside the one it reads); what is written into it other than by an update must
    # go into memory of the bucket's own first (:meth:`own_param`), as workers may be reading it
    param_on_board: bool = False
    # How the moments are stored (optimizer_node.moments.codec): None, fp32 as torch keeps them.
    codec: MomentCodec | None = None

    def __post_init__(self) -> None:
        if self.numel < 0:
            self.numel = self.param.numel()

    def new_revision(self) -> None:
        """``param`` was replaced other than by an update: what was sent of it before is not it."""
        self.revision = next(_revisions)

    def own_param(self) -> None:
        """Move ``param`` off the parameter board into memory of its own (before it is written other
        than by an update, or updated without a board slot to write into)."""
        if self.param_on_board:
            self.param = self.param.clone()
            self.param_on_board = False

    def numpy_state(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Zero-copy numpy views of ``param``, ``exp_avg``, ``exp_avg_sq`` and ``step_tensor``."""
        cached = self._arrays
        if cached is not None:  # once a bucket update: identity checks, spelled out
            held = cached[0]
            if held[0] is self.param and held[1] is self.exp_avg and held[2] is self.exp_avg_sq and held[3] is self.step_tensor:
                return cached[1]
        tensors = (self.param, self.exp_avg, self.exp_avg_sq, self.step_tensor)
        cached = self._arrays = (tensors, tuple(t.numpy() for t in tensors))
        return cached[1]

    def segment_step_counts(self, segments: int) -> list[float]:
        """Each of the bucket's ``segments`` AdamW step counts."""
        return list(self.segment_steps) if self.segment_steps is not None else [float(self.step_tensor)] * segments

    def set_segment_step_counts(self, counts: list[float]) -> None:
        """Take every segment's step count: one count for the bucket when they agree (the fast path)."""
        if all(count == counts[0] for count in counts):
            self.step_tensor.fill_(counts[0])
            self.segment_steps = None
        else:
            self.segment_steps = list(counts)

    def moment(self, part: str) -> torch.Tensor:
        """Moment ``part`` (``exp_avg`` or ``exp_avg_sq``) as fp32, ``numel`` values: the tensor itself
        for fp32 moments, a decoded copy otherwise (the bucket acquired)."""
        encoded = getattr(self, part)
        return encoded if self.codec is None else self.codec.decode(encoded, SIGNED[part])

    def set_moment(self, part: str, values: torch.Tensor) -> None:
        """Replace moment ``part`` with the fp32 ``values`` (rounded to the job's format)."""
        encoded = getattr(self, part)
        if self.codec is None:
            encoded.copy_(values)
        else:
            self.codec.encode(values, encoded, SIGNED[part])

    @property
    def moment_bytes(self) -> int:
        """Bytes of one moment as stored."""
        return moment_bytes(self.codec, self.numel)

    def reduction_buffer(self) -> torch.Tensor:
        if self.grad is None:
            self.grad = torch.empty(self.numel, dtype=torch.float32)
        return self.grad

    @property
    def state_bytes(self) -> int:
        """Bytes held: parameters and both moments, plus the reduction buffer if one was needed."""
        return 4 * self.numel * (1 if self.grad is None else 2) + 2 * self.moment_bytes


def no_store_io() -> dict[str, int]:
    """:meth:`BucketStore.io_counters` of a store without files."""
    return {"bytes_read": 0, "bytes_written": 0}


class BucketStore(ABC):
    """The node's state, one :class:`BucketState` per owned bucket."""

    last_error: str | None = None  # the last failure of background work (a write behind), for status

    params_movable = False
    """Whether a bucket's ``param`` may become a view of memory elsewhere (the parameter board's
    slots): in memory, yes; out of core the store reads and writes its own buffers."""

    def master_bytes_on_board(self) -> int:
        """Bytes of fp32 master values kept on the parameter board (none where :attr:`params_movable` is False)."""
        return 0

    @abstractmethod
    def create(self, bucket_id: int, initial: torch.Tensor, codec: MomentCodec | None = None) -> BucketState:
        """Create a bucket from its initial fp32 values (copied), its moments zero in ``codec``'s
        format (``None``: fp32); ``ValueError`` if it exists."""

    @abstractmethod
    def get(self, bucket_id: int) -> BucketState | None:
        """The bucket's state, or ``None`` if it was never created."""

    @abstractmethod
    def __iter__(self) -> Iterator[BucketState]:
        """All created buckets in id order."""

    @abstractmethod
    def __len__(self) -> int: ...

    # Residency. In memory everything is always resident, so these do nothing.

    reads_ahead = False
    """Whether :meth:`prefetch` does anything (a store whose buckets are not all resident)."""

    def expect_buckets(self, numels: Sequence[int]) -> None:
        """The registered job's buckets on this node (their element counts), before their state is
        made: a store with a memory budget says if the budget leaves it no room to overlap its I/O."""
        return None

    def prefetch(self, bucket_id: int) -> None:
        """The bucket will be acquired soon: start loading it if it is not resident."""
        return None

    def acquire(self, state: BucketState) -> None:
        """Make the bucket's tensors resident and keep them so until :meth:`release` (blocks)."""
        return None

    def params_for_send(self, state: BucketState) -> torch.Tensor:
        """The bucket's fp32 parameters to send (read-only use); need not be acquired."""
        return state.param

    def params_resident(self, state: BucketState) -> bool:
        """Whether :meth:`params_for_send` would find the parameters in memory (no read, no wait)."""
        return True

    def release(self, state: BucketState, *, dirty: bool) -> None:
        """Done with the tensors; ``dirty`` if they were changed."""
        return None

    def poll(self) -> None:
        """Finish background work that completed (called by the daemon between messages)."""
        return None

    def resident_bytes(self) -> int:
        """Bytes of state held in memory now."""
        return sum(state.state_bytes for state in self)

    def disk_bytes(self) -> int:
        """Bytes of state in files now (each bucket's newest version): none for a store in memory."""
        return 0

    def io_counters(self) -> dict[str, int]:
        """State bytes read from and written to files since the store was made; plain integers, so
        another thread may read them."""
        return no_store_io()

    def close(self) -> None:
        """Finish background work and release resources."""
        return None

    # Checkpoints.

    def write_checkpoint_file(self, state: BucketState, path: Path) -> dict[str, int | str]:
        """Put the bucket's state (param as fp32, exp_avg, exp_avg_sq as stored, back to back) in ``path``,
        durably; returns ``bytes`` and a checksum (``sha256`` or ``xxh3_64``) for the manifest."""
        self.acquire(state)
        try:
            return write_synced(path, [raw_bytes(state.param), raw_bytes(state.exp_avg), raw_bytes(state.exp_avg_sq)])
        finally:
            self.release(state, dirty=False)

    def restore(self, bucket_id: int, step: int, step_tensor: float, path: Path, numel: int, codec: MomentCodec | None = None) -> BucketState:
        """Create a bucket from a verified checkpoint file (the caller restores ``segment_steps``)."""
        moment = moment_bytes(codec, numel)
        raw = torch.from_file(str(path), shared=False, size=4 * numel + 2 * moment, dtype=torch.uint8)
        state = self.create(bucket_id, raw[: 4 * numel].view(torch.float32), codec)
        self.acquire(state)
        for index, part in enumerate(("exp_avg", "exp_avg_sq")):
            stored = raw[4 * numel + index * moment : 4 * numel + (index + 1) * moment]
            getattr(state, part).view(torch.uint8).copy_(stored)
        state.step_tensor.fill_(step_tensor)
        state.step = step
        self.release(state, dirty=True)
        return state


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().contiguous().numpy()).cast("B")


def write_synced(path: Path, chunks: list[memoryview]) -> dict[str, int | str]:
    """Write ``chunks`` to a new file at ``path`` and fsync it; ``bytes`` and ``sha256`` of what was written."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as handle:
        for chunk in chunks:
            handle.write(chunk)
            digest.update(chunk)
            size += len(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    return {"bytes": size, "sha256": digest.hexdigest()}


class InMemoryStore(BucketStore):
    """All state resident in host memory."""

    params_movable = True

    def master_bytes_on_board(self) -> int:
        """Bytes of fp32 master values kept on the parameter board (see :attr:`BucketState.param_on_board`);
        safe to call from another thread (the buckets are listed at once, under the interpreter's lock)."""
        return sum(4 * state.numel for state in list(self._buckets.values()) if state.param_on_board)

    def __init__(self) -> None:
        self._buckets: dict[int, BucketState] = {}

    def create(self, bucket_id: int, initial: torch.Tensor, codec: MomentCodec | None = None) -> BucketState:
        if bucket_id in self._buckets:
            raise ValueError(f"bucket {bucket_id} already exists")
        numel = initial.numel()
        if codec is not None and codec.numel != numel:
            raise ValueError(f"bucket {bucket_id} has {numel} elements, its moments' layout {codec.numel}")
        state = BucketState(
            bucket_id=bucket_id,
            param=initial.to(torch.float32, copy=True).reshape(-1),
            exp_avg=torch.zeros(numel, dtype=torch.float32) if codec is None else codec.zeros(),
            exp_avg_sq=torch.zeros(numel, dtype=torch.float32) if codec is None else codec.zeros(),
            step_tensor=torch.zeros((), dtype=torch.float32),
            codec=codec,
        )
        self._buckets[bucket_id] = state
        return state

    def get(self, bucket_id: int) -> BucketState | None:
        return self._buckets.get(bucket_id)

    def __iter__(self) -> Iterator[BucketState]:
        return iter(sorted(self._buckets.values(), key=lambda b: b.bucket_id))

    def __len__(self) -> int:
        return len(self._buckets)
