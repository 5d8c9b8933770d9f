"""The node's ready updates and how they run.

A bucket is ready once every rank's gradient of its step is in (or, with a global round, once the
round let it go). Ready buckets are updated lowest id first: the bucket the next forward pass needs
first. An update runs on the serve loop's thread, or, with ``--pass-thread``, its pass runs on the
pass thread (:mod:`optimizer_node.update.pass_thread`) while the loop goes on receiving and sending; what
comes before and after the pass stays on the loop's thread (:class:`BucketApply`). Updates are held
while an operator paused them, and for ``STORAGE_RETRY_S`` after the store failed (a full disk, a
damaged state file): the gradients wait, nothing is lost.

A message is handled as if no pass ran (:meth:`UpdateQueue.settle_for`): a PUSH or PULL waits for
the passes of the buckets it names, any other message for every pass.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from optimizer_node.state.storage import StorageError
from transport.wire import Header, MsgType

if TYPE_CHECKING:
    from optimizer_node.job_state import CurrentJob
    from optimizer_node.state.storage import BucketStore
    from optimizer_node.update.bucket_apply import BucketApply, Deliver, PendingUpdate
    from optimizer_node.update.pass_thread import PassThread

log = logging.getLogger(__name__)

STORAGE_RETRY_S = 1.0
"""After the store failed (disk full, a damaged state file), updates are retried this often."""


class UpdateQueue:
    """One job's ready updates: a heap of bucket ids, run lowest first, here or on the pass thread.

    ``current``: where the job stands (its job, ranks, store, steps in flight); ``deliver``: what sends
    a bucket's new values once updated; ``flush``: sends the values batched so far; ``passes``: the
    node's pass thread, ``None`` without ``--pass-thread``; ``paused``: whether an operator holds the
    updates (the operator owns the pause)."""

    def __init__(
        self,
        current: CurrentJob,
        bucket_apply: BucketApply,
        deliver: Deliver,
        flush: Callable[[], None],
        passes: PassThread[PendingUpdate] | None,
        *,
        paused: Callable[[], bool],
    ) -> None:
        self._current = current
        self._store: BucketStore = current.store
        self._bucket_apply = bucket_apply
        self._in_flight = current.in_flight
        self._paused = paused
        self._deliver = deliver
        self._flush = flush
        self.passes = passes
        self.ready: list[int] = []  # heap of bucket ids whose gradients are complete (the global round pushes here too)
        self.storage_error: str | None = None  # the last failure of the bucket store, until an update succeeds
        self._retry_at = 0.0

    def push(self, bucket_id: int) -> None:
        """``bucket_id``'s gradients are complete: its update is ready."""
        heapq.heappush(self.ready, bucket_id)

    def clear(self) -> None:
        """Forget the ready updates (the job changes its width: their gradients are dropped)."""
        self.ready.clear()

    def can_apply(self) -> bool:
        """Whether an update is ready and may run now (not paused, no store failure to wait out)."""
        return bool(self.ready) and not self._paused() and time.monotonic() >= self._retry_at

    def apply_next(self, *, here: bool = False) -> bool:
        """Apply the ready update of the lowest bucket id (with a pass thread: hand its pass over,
        unless ``here``); False if none is ready, updates are paused, or the pass thread has no room."""
        ready = self.ready
        if not ready or self._paused():
            return False
        passes = None if here else self.passes
        if passes is not None and not passes.has_room:
            return False
        job = self._current.job
        assert job is not None, "a ready update belongs to the registered job"
        bucket_id = heapq.heappop(ready)
        store = self._store
        if store.reads_ahead:
            # Out of core: read the next two while this one updates. They are the heap's root and the
            # smaller of its children (nsmallest would scan the whole heap: O(buckets) per update).
            for upcoming in ready[:1] + sorted(ready[1:3])[:1]:
                store.prefetch(upcoming)
        state = store.get(bucket_id)
        assert state is not None, "a bucket with gradients has state"
        try:
            if passes is None:
                self._bucket_apply.apply(job, state, self._in_flight[bucket_id], self._current.ledger, self._deliver)
            else:
                passes.submit(bucket_id, self._bucket_apply.begin(job, state, self._in_flight[bucket_id], self._current.ledger))
        except StorageError as exc:
            heapq.heappush(ready, bucket_id)  # nothing was applied: its gradients wait for the retry
            self.storage_error = str(exc)
            self._retry_at = time.monotonic() + STORAGE_RETRY_S
            log.error("bucket %d not updated, retrying in %.0f s: %s", bucket_id, STORAGE_RETRY_S, exc)
            return False
        self.storage_error = None
        return True

    def hand_over(self) -> None:
        """Hand the pass thread as many ready passes as it takes (one running, the next queued)."""
        while self.apply_next():
            pass

    def apply_all_ready(self) -> int:
        """Apply every ready update now, lowest bucket id first, on this thread; returns how many."""
        self.settle()
        applied = 0
        while self.apply_next(here=True):
            applied += 1
        self._flush()
        return applied

    @property
    def passing(self) -> bool:
        """Whether a pass runs (or waits to be finished) on the pass thread."""
        return self.passes is not None and self.passes.busy

    def finish_ended(self) -> None:
        """Finish the passes that ended on the pass thread, in order: their buckets' new values out.
        No system call: the loop asks at every turn while passes run."""
        if self.passes is not None and self.passes.busy:
            self._finish(self.passes.collect())

    def woken(self) -> None:
        """The serve loop's wait returned without a message: a pass that ended may have woken it."""
        if self.passes is not None:
            self.passes.drain_wakeup()
            self._finish(self.passes.collect())

    def settle(self, bucket_id: int | None = None) -> None:
        """Wait for bucket ``bucket_id``'s pass (every pass: ``None``) and finish what ended."""
        if self.passes is not None and self.passes.busy:
            self._finish(self.passes.wait(bucket_id))

    def settle_for(self, header: Header, batched: bool) -> None:
        """Before ``header``'s message is handled: a PUSH or PULL waits for the passes of the buckets
        it names (a batch: those it lists), any other message (rare while gradients stream in) for
        every pass."""
        passes = self.passes
        if passes is None or not passes.busy:
            return
        if header.msg_type not in (MsgType.PUSH, MsgType.PULL):
            self.settle()
        elif not batched:
            if passes.holds(header.bucket_id):
                self.settle(header.bucket_id)
        else:
            entries = header.meta.get("batch")
            if not isinstance(entries, list):  # malformed: refused once checked; nothing of it runs beside a pass
                self.settle()
                return
            for bucket_id in passes.held():  # at most two, against a batch of up to thousands
                if any(isinstance(entry, list) and entry and entry[0] == bucket_id for entry in entries):
                    self.settle(bucket_id)

    def _finish(self, ended: list[tuple[PendingUpdate, BaseException | None]]) -> None:
        for pending, error in ended:
            self._bucket_apply.finish(pending, error, self._deliver)
