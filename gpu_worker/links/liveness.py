"""How long a worker waits for its nodes, and how it tells a node that is gone from one that is busy.

While a worker waits for a node, it pings every node it has not heard from for ``heartbeat_s`` (a
QUERY, answered with STATUS even while the node waits for other ranks or is paused). A node silent
for ``silent_after_s`` despite the pings is taken for gone: the worker reconnects to the address it
was given, for up to ``reconnect_s``, and continues where the node is (a node restarted with
``--resume``), or fails with an error that names the address. A connection the transport sees drop
(a reset, a node killed) is reconnected to at once, the same way. Both need ``timeout_s >=
silent_after_s`` (see ``WorkerTimeouts.reconnects``). Time spent computing does not count: silence
is measured from when the worker started waiting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class WorkerTimeouts:
    """A worker's deadlines, in seconds."""

    timeout_s: float = 300.0
    """Longest wait without progress (nodes alive but the step not moving: a missing rank, a pause)."""

    connect_timeout_s: float = 30.0
    """Longest wait for a node's first answer to HELLO (a wrong or dead address fails after this, or
    after ``timeout_s`` if that is shorter)."""

    @property
    def first_answer_s(self) -> float:
        """How long a HELLO may go unanswered: the shorter of the two limits."""
        return min(self.connect_timeout_s, self.timeout_s)

    heartbeat_s: float = 2.0
    """Ping a node after this much silence while waiting for it."""

    silent_after_s: float = 10.0
    """A node silent this long despite pings is taken for gone, and reconnected to."""

    reconnect_s: float = 20.0
    """How long to try to reach a gone node again (it may be restarting) before failing."""

    @property
    def reconnects(self) -> bool:
        """Whether a worker reconnects to a node that is gone or whose connection dropped. Only when
        ``timeout_s`` leaves room for a node to fall silent (``timeout_s >= silent_after_s``): with a
        shorter deadline the user asked for waits that fail fast, and a wait fails at its deadline,
        with each node's account, whatever the cause."""
        return self.timeout_s >= self.silent_after_s

    def validate(self) -> None:
        for name in ("timeout_s", "connect_timeout_s", "heartbeat_s", "silent_after_s", "reconnect_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.heartbeat_s >= self.silent_after_s:
            raise ValueError(
                f"heartbeat_s ({self.heartbeat_s}) must be below silent_after_s ({self.silent_after_s}): a node is pinged before it counts as gone"
            )


class NodeLiveness:
    """When each node was last heard from and pinged (monotonic seconds)."""

    def __init__(self, num_nodes: int, timeouts: WorkerTimeouts) -> None:
        self.timeouts = timeouts
        now = time.monotonic()
        self._heard = [now] * num_nodes
        self._pinged = [0.0] * num_nodes

    def start_waiting(self) -> None:
        """Silence counts from now: time the worker spent computing is not the nodes' silence."""
        now = time.monotonic()
        self._heard = [max(heard, now) for heard in self._heard]

    def heard(self, index: int) -> None:
        self._heard[index] = time.monotonic()

    def silent_for(self, index: int) -> float:
        return time.monotonic() - self._heard[index]

    def to_ping(self) -> list[int]:
        """Nodes silent for a heartbeat and not pinged within one; marks them pinged."""
        now = time.monotonic()
        due = [i for i, heard in enumerate(self._heard) if now - heard >= self.timeouts.heartbeat_s and now - self._pinged[i] >= self.timeouts.heartbeat_s]
        for index in due:
            self._pinged[index] = now
        return due

    def gone(self) -> list[int]:
        """Nodes silent for ``silent_after_s`` despite pings."""
        now = time.monotonic()
        return [i for i, heard in enumerate(self._heard) if now - heard >= self.timeouts.silent_after_s]
