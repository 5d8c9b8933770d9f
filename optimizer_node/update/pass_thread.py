"""The update passes on a thread of their own, so the node's loop receives and sends while they run.

A node's loop does per-bucket work besides the pass (checking and taking each push, sending each
bucket's new values, the bookkeeping around both); on one thread that work and the passes take turns,
and the update threads wait while the loop works. :class:`PassThread` runs the passes (which hold no
interpreter lock: the compiled loop releases it, torch's ops too) one after another on a thread of
their own, at most :data:`DEPTH` handed over at once: the next is queued while one runs, so the
thread goes from one pass to the next without waiting for the loop. The loop hands a pass over
(:meth:`PassThread.submit`), takes the finished ones back (:meth:`PassThread.collect`) and finishes
them itself: everything besides the pass stays on the loop's thread.

The thread writes to an event file descriptor when a pass ends; the node's endpoint wakes its wait
for messages on it (``ServerEndpoint.wake_on``), so a finished pass is taken back at once.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from transport.host_threads import name_os_thread

log = logging.getLogger(__name__)

DEPTH = 2
"""Passes handed over at most: one running, the next queued behind it."""

SWITCH_INTERVAL_S = 0.0002
"""The interpreter's switch interval in a node with a pass thread. Between two passes (and around
each compiled call) the pass thread needs the interpreter lock for a few microseconds; with CPython's
default of 5 ms a serve loop busy with Python work keeps it that long each time, and the update
threads wait. Measured on the 2-core development machine: 32 passes of 1M elements beside a Python
thread that never blocks took 28-41x as long as alone at 5 ms, 2.1-2.5x at 0.5 and 0.1 ms."""


def shorten_switch_interval(seconds: float = SWITCH_INTERVAL_S) -> float:
    """Make the interpreter hand its lock over after at most ``seconds`` (if it waits longer now);
    returns the interval before. Process-wide: for the node's process, which runs a pass thread."""
    before = sys.getswitchinterval()
    if seconds < before:
        sys.setswitchinterval(seconds)
        log.info("interpreter switch interval %.1f ms (was %.1f ms): the pass thread takes the lock between passes", seconds * 1e3, before * 1e3)
    return before


T = TypeVar("T")


class PassThread(Generic[T]):
    """Runs ``run(item)`` for each item submitted, in order, on one thread; items keyed by bucket id."""

    def __init__(self, run: Callable[[T], None], name: str = "update-passes") -> None:
        self._run = run
        self._jobs: queue.SimpleQueue[tuple[int, T] | None] = queue.SimpleQueue()
        self._done: deque[tuple[int, T, BaseException | None]] = deque()
        self._finished = threading.Condition()
        self._outstanding: dict[int, T] = {}  # bucket id -> its item, submitted and not collected yet
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> int:
        """Items submitted and not collected."""
        return len(self._outstanding)

    @property
    def has_room(self) -> bool:
        return len(self._outstanding) < DEPTH

    def holds(self, bucket_id: int) -> bool:
        """Whether bucket ``bucket_id``'s pass is submitted and not collected."""
        return bucket_id in self._outstanding

    def held(self) -> list[int]:
        """The buckets whose passes are submitted and not collected, in order."""
        return list(self._outstanding)

    def submit(self, bucket_id: int, item: T) -> None:
        assert self.has_room and bucket_id not in self._outstanding, "one pass per bucket, at most DEPTH"
        self._outstanding[bucket_id] = item
        self._jobs.put((bucket_id, item))

    def drain_wakeup(self) -> None:
        """Reset the wake-up descriptor, after a wait it woke (a pass taken back through :meth:`wait`
        leaves it readable: undrained, every later wait would return at once)."""
        try:
            os.eventfd_read(self.wake_fd)
        except BlockingIOError:  # nothing ended since the last read
            pass

    def collect(self) -> list[tuple[T, BaseException | None]]:
        """The items whose pass ended since the last call, in order, each with the exception it raised
        (no system call: the loop asks at every turn while passes run)."""
        ended: list[tuple[T, BaseException | None]] = []
        while self._done:
            bucket_id, item, error = self._done.popleft()
            del self._outstanding[bucket_id]
            ended.append((item, error))
        return ended

    def wait(self, bucket_id: int | None = None) -> list[tuple[T, BaseException | None]]:
        """Wait until bucket ``bucket_id``'s pass (every pass: ``None``) ended; the items that ended, as
        :meth:`collect`. Passes end in order, so what was submitted before it ended too."""
        ended: list[tuple[T, BaseException | None]] = []
        while (bucket_id is None and self._outstanding) or (bucket_id is not None and bucket_id in self._outstanding):
            with self._finished:
                self._finished.wait_for(lambda: bool(self._done))
            ended += self.collect()
        return ended

    def close(self) -> None:
        """Stop the thread once the passes handed over ended (the caller collects them first); idempotent."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        if self.wake_fd >= 0:
            os.close(self.wake_fd)
            self.wake_fd = -1

    def _serve(self) -> None:
        name_os_thread()
        while (job := self._jobs.get()) is not None:
            bucket_id, item = job
            error: BaseException | None = None
            try:
                self._run(item)
            except BaseException as exc:  # handed to the loop, which raises it where the pass was finished
                error = exc
            with self._finished:
                self._done.append((bucket_id, item, error))
                self._finished.notify_all()
            os.eventfd_write(self.wake_fd, 1)
