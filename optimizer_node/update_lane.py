"""Bucket updates on a thread of their own, so that a node's loop goes on receiving, checking and
answering while the update pass runs.

The update pass is most of a node's work in a step, and it leaves the loop's thread idle while its
own threads (numba's or torch's) sweep the bucket's memory; the loop's work per bucket (taking a
push, checking it for NaN/inf, sending the new values and telling the ranks) is small but serial. On
one thread each waits for the other; here the loop takes the next pushes and sends the last bucket's
values while the lane updates the next.

The lane computes only: it runs what the loop hands it (the update of one bucket's state, whose
tensors nothing else touches meanwhile) and never sends, logs state, or looks at the node. The loop
starts an update (everything before the pass), hands the pass to the lane, and finishes it (the
step count, the values out) when it is done, in the order they were started. What the loop does
with the lane's buckets meanwhile is its own rule (:class:`~optimizer_node.daemon.NodeDaemon`): it
waits for the lane before anything that reads or changes a bucket's state other than taking a push
for another bucket.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class LaneWork:
    """One bucket's update in the lane: what the loop needs to finish it, and its outcome."""

    bucket_id: int
    step: int  # the step the bucket's gradients are for
    context: Any  # the loop's own record of the update, handed back as it was
    future: Future = field(default_factory=Future)
    seconds: float = 0.0  # the pass's own time, on the lane's thread

    def result(self) -> Any:
        """The pass's return value; its exception, raised here (on the loop's thread)."""
        return self.future.result()


class UpdateLane:
    """At most ``depth`` bucket updates queued on one thread, finished in the order they were started:
    with two, the lane starts the next bucket as soon as one is done, without waiting for the loop to
    see it."""

    def __init__(self, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"an update lane holds at least one update, not {depth}")
        self.depth = depth
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="netoptim-update")
        self._work: collections.deque[LaneWork] = collections.deque()
        self.started = 0  # updates started in the lane since the node started

    def __len__(self) -> int:
        return len(self._work)

    @property
    def has_room(self) -> bool:
        return len(self._work) < self.depth

    @property
    def step(self) -> int | None:
        """The step of the updates in the lane (they are all of one step), or ``None`` when it is empty."""
        return self._work[0].step if self._work else None

    def holds(self, bucket_id: int) -> bool:
        """Whether ``bucket_id``'s update is in the lane (started and not finished by the loop)."""
        return any(work.bucket_id == bucket_id for work in self._work)

    def start(self, bucket_id: int, step: int, context: Any, compute: Callable[[], Any]) -> None:
        """Queue ``compute`` (the pass over one bucket's state) behind the updates in the lane."""
        if not self.has_room:
            raise RuntimeError(f"the update lane holds {self.depth} updates already")
        if self._work and self._work[0].step != step:
            raise RuntimeError(f"the update lane holds updates of step {self._work[0].step}, not {step}")
        work = LaneWork(bucket_id, step, context)

        def run() -> Any:
            started = time.perf_counter()
            try:
                return compute()
            finally:
                work.seconds = time.perf_counter() - started

        work.future = self._executor.submit(run)
        self._work.append(work)
        self.started += 1

    def done(self) -> LaneWork | None:
        """The oldest update, taken out of the lane, if its pass is over; else ``None``."""
        if self._work and self._work[0].future.done():
            return self._work.popleft()
        return None

    def wait(self) -> LaneWork | None:
        """The oldest update, taken out of the lane once its pass is over; ``None`` when the lane is empty."""
        if not self._work:
            return None
        self._work[0].future.exception()  # waits; the exception (if any) is raised by result()
        return self._work.popleft()

    def wait_for_oldest(self, timeout_s: float) -> None:
        """Block until the oldest update's pass is over, or for ``timeout_s`` (the loop's look for
        messages in between: it does not spin while the lane works)."""
        if self._work:
            concurrent.futures.wait([self._work[0].future], timeout=timeout_s)

    def close(self) -> None:
        """Let the passes in the lane finish, then stop its thread."""
        self._executor.shutdown(wait=True)
