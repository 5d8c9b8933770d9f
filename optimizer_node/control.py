"""How other threads (the admin service) reach a daemon whose state only its own thread touches.

A caller submits a function; the daemon thread runs it between two messages and the caller gets the
result (or the exception) through a future. Step events go the other way: the daemon publishes, any
number of subscribers read from their own queues.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


class CommandQueue:
    """Functions to run on the daemon thread."""

    def __init__(self) -> None:
        self._pending: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()

    def call(self, function: Callable[[], T], timeout_s: float = 10.0) -> T:
        """Run ``function`` on the daemon thread and return its result; ``TimeoutError`` if the daemon
        does not get to it within ``timeout_s`` (it is stopped, or stuck in a long update)."""
        future: Future = Future()
        self._pending.put((function, future))
        return future.result(timeout_s)

    @property
    def waiting(self) -> bool:
        """Whether something was submitted that has not run yet."""
        return not self._pending.empty()

    def run_pending(self) -> None:
        """Called by the daemon thread: run everything submitted so far."""
        while True:
            try:
                function, future = self._pending.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function())
            except BaseException as exc:  # handed to the caller, never raised in the daemon
                future.set_exception(exc)


@dataclass(slots=True)
class StepTimings:
    """Where the time of one node step went."""

    wall_s: float = 0.0  # first gradient in -> last bucket sent
    tail_s: float = 0.0  # last gradient in -> last bucket sent: the node's time after the workers' backward
    reduce_s: float = 0.0
    update_s: float = 0.0
    send_s: float = 0.0
    passes: list[float] = field(default_factory=list)  # each bucket's update pass, seconds (of update_s; the rest is bookkeeping)

    def pass_percentiles(self, *quantiles: float) -> tuple[float, ...]:
        """The ``quantiles`` (0..1, nearest rank) of the step's per-bucket pass times, seconds; zeros without any."""
        if not self.passes:
            return tuple(0.0 for _ in quantiles)
        ordered = sorted(self.passes)
        return tuple(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] for q in quantiles)


@dataclass(slots=True)
class StepEvent:
    step: int
    unix_time: float
    timings: StepTimings


@dataclass(slots=True)
class StepClock:
    """Accumulates the current step's timings and tells subscribers when a step completes."""

    current: StepTimings = field(default_factory=StepTimings)
    last: StepTimings = field(default_factory=StepTimings)
    started: float | None = None
    last_gradient: float = 0.0  # when the current step's last gradient so far came in
    _subscribers: list[queue.SimpleQueue] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def gradient_arrived(self) -> None:
        self.last_gradient = now = time.perf_counter()
        if self.started is None:
            self.started = now

    def step_completed(self, step: int) -> None:
        now = time.perf_counter()
        if self.started is not None:
            self.current.wall_s = now - self.started
            self.current.tail_s = now - self.last_gradient
        self.last, self.current, self.started = self.current, StepTimings(), None
        event = StepEvent(step, time.time(), self.last)
        with self._lock:
            for subscriber in self._subscribers:
                subscriber.put(event)

    def subscribe(self) -> queue.SimpleQueue:
        """A queue that receives every later :class:`StepEvent` (and ``None`` when the node stops)."""
        subscriber: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._subscribers.append(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: queue.SimpleQueue) -> None:
        with self._lock:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)

    def close(self) -> None:
        with self._lock:
            for subscriber in self._subscribers:
                subscriber.put(None)
            self._subscribers.clear()
