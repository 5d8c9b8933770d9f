"""Out-of-core bucket state: fp32 parameters and AdamW moments in files, under a memory budget.

Each bucket's state is one file, ``bucket-NNNNNN.vSSSSSSSSSS.bin`` (param, exp_avg, exp_avg_sq as fp32,
back to back: the checkpoint file format), where ``S`` is the step it holds. A version that anything
refers to never changes once written, so a checkpoint is a hard link to each bucket's current file
(no copy), and a torn write never damages it. The next version goes into the old version's file,
renamed to the new name, when nothing but the store links it (no checkpoint): the old version is
retired by then (the values in memory are newer), and the file system is spared allocating pages
and blocks for every write and freeing the old ones; else to a new file, the old name unlinked
once it is written.
Every write records the file's size, inode, mtime and checksum (XXH3); a read checks all four, so a file
truncated, replaced or edited under the node is an error, not silent garbage.

Residency: a bucket being updated or sent is *acquired* (resident, pinned). Other resident buckets
are a cache: when the whole state fits the budget they stay (nothing is written until a checkpoint
or an eviction needs it); when it does not, a bucket is written back as soon as it is released and
its memory freed once the write is done. The daemon says which buckets come next (``prefetch``):
reads run on I/O threads while it updates another bucket and earlier writes drain, the read
``i+1`` / update ``i`` / write ``i-1`` pipeline. All bookkeeping happens on the daemon thread; the I/O
threads only read or write a buffer they are handed. A fetch of a bucket not resident reads only
its parameter third.

I/O (docs/operations.md): one request per file, from a pool of ``io_threads`` for reads and one for
writes; without ``sync`` through the page cache, with it ``fdatasync`` after every write and
``O_DIRECT`` where the file system takes it (:mod:`optimizer_node.state.ooc_files`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from optimizer_node.moments.codec import MomentCodec
from optimizer_node.state.ooc_files import (
    DIGEST,
    FileInfo,
    SpareStateBuffers,
    describe_file,
    link_or_copy,
    probe_direct_io,
    read_checked,
    reusable,
    state_buffer,
    write_version,
)
from optimizer_node.state.storage import BucketState, BucketStore, StorageError
from transport.host_memory import map_large_allocations
from transport.host_threads import name_os_thread

log = logging.getLogger(__name__)

_EVICTED = torch.empty(0, dtype=torch.float32)
BYTES_PER_PARAM = 12
"""Bytes of state per parameter with fp32 moments (the estimate before a job says its format)."""


def _nbytes(state: BucketState) -> int:
    """Bytes of the bucket's state in memory and in its file: fp32 parameters and both moments as stored."""
    return 4 * state.numel + 2 * state.moment_bytes


OVERLAP_BUCKETS = 4
"""Buckets of state the budget should hold for the I/O to overlap the updates: the one updated, the
next read ahead, the last written back, and room for one more."""


@dataclass(eq=False, slots=True)
class _Slot:
    state: BucketState
    flat: torch.Tensor | None = None  # the state's bytes as fp32 words while resident (param, then the moments as stored)
    file: FileInfo | None = None  # the newest version on disk
    dirty: bool = False  # resident values are newer than the file
    pins: int = 0
    reading: Future | None = None
    writing: Future | None = None
    last_use: int = 0


class OutOfCoreStore(BucketStore):
    """Bucket state in files under ``state_dir``, at most ``memory_budget`` bytes of it in memory.

    ``io_threads`` threads read and as many write; ``sync`` makes every write durable before it
    counts and keeps the state out of the page cache (see the module docstring)."""

    def __init__(self, state_dir: str | Path, memory_budget: int, *, io_threads: int = 2, sync: bool = False) -> None:
        if memory_budget <= 0:
            raise ValueError(f"memory_budget must be positive, got {memory_budget}")
        self.state_dir = Path(state_dir)
        self.memory_budget = memory_budget
        self.sync = sync
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            probe = self.state_dir / ".write-probe"
            probe.write_bytes(b"netoptim")
            probe.unlink()
        except OSError as exc:
            raise StorageError(f"cannot use {self.state_dir} as the state directory: {exc.strerror or exc}; give --state-dir a writable directory") from None
        for stale in self.state_dir.glob("bucket-*.bin"):  # scratch of an earlier run; checkpoints are elsewhere
            stale.unlink()
        # sync: state moves with O_DIRECT where the file system takes it (see ooc_files); without
        # sync the page cache is the point, as a second cache above the budget.
        self.direct = sync and probe_direct_io(self.state_dir)
        log.info(
            "out-of-core state in %s: budget %d bytes, %d I/O threads, %s",
            self.state_dir,
            memory_budget,
            io_threads,
            ("fdatasync, direct I/O" if self.direct else "fdatasync, page cache dropped") if sync else "buffered",
        )
        map_large_allocations()  # so what is freed (frames, parameters sent) leaves the RSS too
        self._slots: dict[int, _Slot] = {}
        self._spare = SpareStateBuffers()
        # Reads and writes on pools of their own: the update waits for a read, never for a write
        # (until room is short), so a read must not queue behind writes that wait out fdatasync.
        self._readers = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="netoptim-read", initializer=name_os_thread)
        self._writers = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="netoptim-write", initializer=name_os_thread)
        self._resident = 0
        self._total = 0
        self._clock = 0
        self.bytes_read = 0
        self.bytes_written = 0

    # ---------------------------------------------------------------- BucketStore

    def expect_buckets(self, numels: Sequence[int]) -> None:
        largest = BYTES_PER_PARAM * max(numels, default=0)
        if BYTES_PER_PARAM * sum(numels) > self.memory_budget and self.memory_budget < OVERLAP_BUCKETS * largest:
            log.warning(
                "the memory budget (%.0f MiB) holds fewer than %d of this job's largest buckets (%.0f MiB of state each): the node cannot read "
                "the next bucket and write the last one back while it updates one; raise --memory-budget, or give the workers a smaller "
                "bucket_numel (a 1M-element bucket is 12 MiB of state)",
                self.memory_budget / 2**20,
                OVERLAP_BUCKETS,
                largest / 2**20,
            )

    def create(self, bucket_id: int, initial: torch.Tensor, codec: MomentCodec | None = None) -> BucketState:
        if bucket_id in self._slots:
            raise ValueError(f"bucket {bucket_id} already exists")
        numel = initial.numel()
        if codec is not None and codec.numel != numel:
            raise ValueError(f"bucket {bucket_id} has {numel} elements, its moments' layout {codec.numel}")
        state = BucketState(bucket_id=bucket_id, param=_EVICTED, exp_avg=_EVICTED, exp_avg_sq=_EVICTED, step_tensor=torch.zeros(()), numel=numel, codec=codec)
        self._make_room(_nbytes(state), block=True)  # may fail (disk full): then nothing is registered
        slot = _Slot(state)
        self._slots[bucket_id] = slot
        self._total += _nbytes(state)
        self._make_resident(slot)
        slot.flat.zero_()  # type: ignore[union-attr]
        state.param.copy_(initial.reshape(-1))
        slot.dirty = True
        self._after_use(slot)
        return state

    def get(self, bucket_id: int) -> BucketState | None:
        slot = self._slots.get(bucket_id)
        return None if slot is None else slot.state

    def __iter__(self) -> Iterator[BucketState]:
        return iter([self._slots[b].state for b in sorted(self._slots)])

    def __len__(self) -> int:
        return len(self._slots)

    def resident_bytes(self) -> int:
        return self._resident

    def disk_bytes(self) -> int:
        return sum(slot.file.size for slot in self._slots.values() if slot.file is not None)

    def io_counters(self) -> dict[str, int]:
        return {"bytes_read": self.bytes_read, "bytes_written": self.bytes_written}

    @property
    def total_bytes(self) -> int:
        """Bytes of all buckets' state, resident or not."""
        return self._total

    reads_ahead = True

    def prefetch(self, bucket_id: int) -> None:
        slot = self._slots.get(bucket_id)
        if slot is None or slot.flat is not None or slot.file is None:
            return
        if not self._make_room(_nbytes(slot.state), block=False):
            return  # no room without waiting: the acquire will read it
        self._start_read(slot)

    def acquire(self, state: BucketState) -> None:
        slot = self._slots[state.bucket_id]
        slot.pins += 1  # pinned first: nothing below may evict it
        try:
            if slot.writing is not None:  # its last values are still being written: no changes until done
                self._finish_write(slot)
            if slot.flat is None:
                self._make_room(_nbytes(state), block=True)
                self._start_read(slot)
            if slot.reading is not None:
                self._finish_read(slot)
        except BaseException:
            slot.pins -= 1
            raise

    def params_for_send(self, state: BucketState) -> torch.Tensor:
        """The bucket's parameters: the resident ones, or only the parameter third of its file read
        into a fresh tensor (a fetch needs a third of the bytes an update does)."""
        slot = self._slots[state.bucket_id]
        if slot.reading is not None:
            self._finish_read(slot)
        if slot.flat is not None:
            return state.param
        assert slot.file is not None
        param = state_buffer(state.numel)
        try:
            read_checked(
                self._path(state.bucket_id, slot.file.step), param, slot.file, expected_digest=slot.file.param_digest, sync=self.sync, direct=self.direct
            )
        except (OSError, StorageError) as exc:
            raise StorageError(
                f"bucket {state.bucket_id}: cannot read its state: {exc}; its state is lost: restart the node with --resume from a checkpoint"
            ) from None
        self.bytes_read += param.numel() * 4
        return param

    def params_resident(self, state: BucketState) -> bool:
        slot = self._slots[state.bucket_id]
        return slot.flat is not None and slot.reading is None

    def release(self, state: BucketState, *, dirty: bool) -> None:
        slot = self._slots[state.bucket_id]
        assert slot.pins > 0, "release without acquire"
        slot.pins -= 1
        slot.dirty |= dirty
        self._after_use(slot)

    def poll(self) -> None:
        for slot in self._slots.values():
            if slot.writing is not None and slot.writing.done():
                try:
                    self._finish_write(slot)
                except StorageError as exc:  # the values stay in memory, dirty; the write is tried again when room is needed
                    log.error("%s", exc)
                    self.last_error = str(exc)

    def flush(self) -> None:
        """Wait for the writes in flight; a failed one is logged and left dirty, as in :meth:`poll`."""
        for slot in list(self._slots.values()):
            if slot.writing is not None:
                try:
                    self._finish_write(slot)
                except StorageError as exc:
                    log.error("%s", exc)
                    self.last_error = str(exc)

    def close(self) -> None:
        self.flush()
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)

    def write_checkpoint_file(self, state: BucketState, path: Path) -> dict[str, int | str]:
        """Hard-link the bucket's current file (written first if memory holds newer values)."""
        slot = self._slots[state.bucket_id]
        if slot.writing is not None:
            self._finish_write(slot)
        if slot.dirty or slot.file is None or slot.file.step != state.step:
            self._start_write(slot)
            self._finish_write(slot)
        assert slot.file is not None
        link_or_copy(self._path(state.bucket_id, slot.file.step), path, durable=True)
        return {"bytes": slot.file.size, DIGEST: slot.file.digest}

    def restore(self, bucket_id: int, step: int, step_tensor: float, path: Path, numel: int, codec: MomentCodec | None = None) -> BucketState:
        """Adopt a verified checkpoint file as the bucket's current version (a hard link, no copy)."""
        state = BucketState(
            bucket_id=bucket_id,
            param=_EVICTED,
            exp_avg=_EVICTED,
            exp_avg_sq=_EVICTED,
            step_tensor=torch.tensor(float(step_tensor)),
            numel=numel,
            codec=codec,
        )
        state.step = step
        target = self._path(bucket_id, step)
        link_or_copy(path, target, durable=False)  # the state directory is scratch: a crash starts from the checkpoint again
        slot = _Slot(state, file=describe_file(target, step, param_bytes=4 * numel))
        self._slots[bucket_id] = slot
        self._total += _nbytes(state)
        return state

    # ---------------------------------------------------------------- residency

    def _path(self, bucket_id: int, step: int) -> Path:
        return self.state_dir / f"bucket-{bucket_id:06d}.v{step:010d}.bin"

    def _make_resident(self, slot: _Slot) -> None:
        self._make_room(_nbytes(slot.state), block=True)
        slot.flat = self._buffer(slot.state)
        self._resident += _nbytes(slot.state)
        self._bind(slot)

    def _buffer(self, state: BucketState) -> torch.Tensor:
        """A state buffer for the bucket (fp32 words): a spare one, else a new one (the caller made room)."""
        return self._spare.take(_nbytes(state) // 4, room=self.memory_budget - self._resident)

    def _bind(self, slot: _Slot) -> None:
        state = slot.state
        numel, words = state.numel, state.moment_bytes // 4
        assert slot.flat is not None
        first, second = slot.flat[numel : numel + words], slot.flat[numel + words :]
        if state.codec is not None:  # the encoded bytes
            first, second = first.view(torch.uint8), second.view(torch.uint8)
        state.param, state.exp_avg, state.exp_avg_sq = slot.flat[:numel], first, second

    def _evict(self, slot: _Slot) -> None:
        assert slot.pins == 0 and not slot.dirty and slot.writing is None and slot.reading is None
        for handle in slot.state.pending_sends:  # zero-copy sends still read the buffer
            handle.wait(60.0)
        slot.state.pending_sends.clear()
        slot.state.param = slot.state.exp_avg = slot.state.exp_avg_sq = _EVICTED
        slot.state.grad = slot.state.wire_copy = None
        assert slot.flat is not None
        self._spare.give(slot.flat)
        slot.flat = None
        self._resident -= _nbytes(slot.state)

    def _make_room(self, nbytes: int, *, block: bool) -> bool:
        """Free memory until ``nbytes`` more fit the budget; False if that needs waiting and ``block`` is off."""
        while self._resident + nbytes > self.memory_budget:
            self.poll()
            idle = [s for s in self._slots.values() if s.flat is not None and s.pins == 0 and s.reading is None]
            clean = [s for s in idle if not s.dirty and s.writing is None]
            if clean:
                self._evict(min(clean, key=lambda s: s.last_use))
                continue
            if not block:
                return False
            writing = [s for s in idle if s.writing is not None]
            if writing:
                self._finish_write(min(writing, key=lambda s: s.last_use))
                continue
            dirty = [s for s in idle if s.dirty]
            if dirty:
                self._start_write(min(dirty, key=lambda s: s.last_use))
                continue
            prefetched = [s for s in self._slots.values() if s.reading is not None and s.pins == 0]
            if prefetched:  # a read nobody waits for yet: let it land, then it can go
                self._finish_read(prefetched[0])
                continue
            if self._resident == 0:
                return True  # one bucket larger than the budget: allow it alone
            raise StorageError(
                f"the memory budget of {self.memory_budget / 2**20:.2f} MiB cannot hold the buckets in use ({self._resident / 2**20:.2f} MiB): raise --memory-budget"
            )
        return True

    def _after_use(self, slot: _Slot) -> None:
        self._clock += 1
        slot.last_use = self._clock
        if slot.pins == 0 and slot.dirty and slot.writing is None and self.total_bytes > self.memory_budget:
            self._start_write(slot)  # over-subscribed: write behind at once, so reads find room

    # ---------------------------------------------------------------- I/O

    def _start_read(self, slot: _Slot) -> None:
        assert slot.file is not None, "a bucket without a file is always resident"
        slot.flat = self._buffer(slot.state)
        self._resident += _nbytes(slot.state)
        slot.reading = self._readers.submit(
            read_checked,
            self._path(slot.state.bucket_id, slot.file.step),
            slot.flat,
            slot.file,
            expected_digest=slot.file.digest,
            sync=self.sync,
            direct=self.direct,
        )

    def _finish_read(self, slot: _Slot) -> None:
        assert slot.reading is not None
        future, slot.reading = slot.reading, None
        try:
            future.result()
        except (OSError, StorageError) as exc:
            assert slot.flat is not None
            self._spare.give(slot.flat)
            slot.flat = None
            self._resident -= _nbytes(slot.state)
            raise StorageError(
                f"bucket {slot.state.bucket_id}: cannot read its state: {exc}; its state is lost: restart the node with --resume from a checkpoint"
            ) from None
        self.bytes_read += _nbytes(slot.state)
        self._bind(slot)

    def _start_write(self, slot: _Slot) -> None:
        assert slot.flat is not None and slot.writing is None
        step = slot.state.step
        path = self._path(slot.state.bucket_id, step)
        overwrite = False
        if slot.file is not None:
            previous = self._path(slot.state.bucket_id, slot.file.step)
            # Through the page cache too: overwriting the cached pages of a file costs 2.5x less CPU
            # than a new file's (pages and blocks allocated, the old file's freed at its unlink, on
            # this thread), and a version replaced before writeback still never reaches the disk.
            if reusable(previous, slot.file):
                try:
                    previous.replace(path)  # the retired version's blocks take the new one: nothing refers to it now
                    overwrite = True
                    slot.file = None
                except OSError as exc:  # then a new file, as without sync
                    log.warning("cannot reuse %s for the next version: %s", previous, exc)
            if not overwrite and slot.file is not None and slot.file.step == step:
                path.unlink(missing_ok=True)  # same step rewritten (a restore): replace it
                slot.file = None
        slot.writing = self._writers.submit(
            write_version, path, slot.flat, step, sync=self.sync, direct=self.direct, overwrite=overwrite, param_bytes=4 * slot.state.numel
        )
        slot.dirty = False

    def _finish_write(self, slot: _Slot) -> None:
        assert slot.writing is not None
        future, slot.writing = slot.writing, None
        try:
            info = future.result()
        except OSError as exc:
            slot.dirty = True  # the values stay in memory; the file being written is removed
            raise StorageError(
                f"bucket {slot.state.bucket_id}: cannot write its state under {self.state_dir}: {exc.strerror or exc}; free space there"
            ) from None
        previous, slot.file = slot.file, info
        if previous is not None and previous.step != info.step:
            self._path(slot.state.bucket_id, previous.step).unlink(missing_ok=True)  # a checkpoint's hard link keeps its data
        self.bytes_written += info.size
        if slot.pins == 0 and not slot.dirty and self.total_bytes > self.memory_budget:
            self._evict(slot)
