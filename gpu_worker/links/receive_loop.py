"""The wait for what a worker's optimizer nodes send.

:class:`ReceiveLoop` takes each message as it comes and hands it on, until the caller's condition
holds. A wait that sees nothing move for the job's timeout raises ``TimeoutError`` with the caller's
account of what is missing and each node's of what it waits for. Once a heartbeat it looks at the
connections: a dropped one, or a node silent for longer than :mod:`gpu_worker.links.liveness` allows, is
reconnected to (when the worker's timeouts allow reconnects), and nodes quiet for a while are pinged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpu_worker.links.liveness import WorkerTimeouts
from gpu_worker.links.step_timings import WorkerStepTimings, elapsed
from transport.interface import Message
from transport.wire import MsgType

if TYPE_CHECKING:
    from gpu_worker.links.connections import NodeConnections


class ReceiveLoop:
    """Receives from one worker's node connections.

    ``dispatch(index, message)`` handles each message but a ping's answer (STATUS: the node is alive,
    which is not progress); ``reconnect(index, why)`` reaches a dropped or silent node again (``why``:
    ``None`` for silence, which the reconnect words itself); ``diagnose(missing)`` words a timeout."""

    def __init__(
        self,
        connections: NodeConnections,
        timeouts: WorkerTimeouts,
        *,
        dispatch: Callable[[int, Message], None],
        reconnect: Callable[[int, str | None], None],
        diagnose: Callable[[str], str],
    ) -> None:
        self._connections = connections
        self._timeouts = timeouts
        self._dispatch = dispatch
        self._reconnect = reconnect
        self._diagnose = diagnose

    def run_until(self, done: Callable[[], bool], missing: Callable[[], str], timings: WorkerStepTimings) -> None:
        """Handle messages until ``done()``; the time spent waiting for them goes to ``timings.wait_s``."""
        connections, timeouts = self._connections, self._timeouts
        connections.liveness.start_waiting()
        deadline = time.monotonic() + timeouts.timeout_s
        check_at = time.monotonic() + timeouts.heartbeat_s  # silence is looked at once a heartbeat, not per message
        while not done():
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(self._diagnose(missing()))
            if now >= check_at:
                check_at = now + timeouts.heartbeat_s / 2
                if timeouts.reconnects and self._reconnect_lost():
                    deadline = time.monotonic() + timeouts.timeout_s
                connections.ping(connections.liveness.to_ping())
            waiting = time.perf_counter()
            ready = connections.wait_readable(max(min(deadline - now, timeouts.heartbeat_s), 0.0))
            timings.wait_s += elapsed(waiting)
            if self._take(ready):
                deadline = time.monotonic() + timeouts.timeout_s

    def take_waiting(self, limit: int) -> None:
        """Handle the messages already here, at most ``limit`` rounds over the nodes, without waiting."""
        for _ in range(limit):
            ready = self._connections.wait_readable(0.0)
            if not ready:
                return
            self._take(ready)

    def _take(self, ready: list[int]) -> bool:
        """One message from each of the ``ready`` nodes, handed on; whether any was more than a ping's answer."""
        progressed = False
        for index in ready:
            message = self._connections.take(index)
            if message is not None and message.header.msg_type != MsgType.STATUS:
                progressed = True
                self._dispatch(index, message)
        return progressed

    def _reconnect_lost(self) -> bool:
        """Reconnect to each node whose connection dropped or that went silent; whether any was."""
        connections = self._connections
        reconnected = False
        for index in connections.dropped():
            self._reconnect(index, "its connection dropped")
            connections.liveness.start_waiting()  # the time spent reconnecting is not the other nodes' silence
            reconnected = True
        for index in connections.liveness.gone():  # asked after the reconnects above, which restarted the clocks
            self._reconnect(index, None)
            connections.liveness.start_waiting()
            reconnected = True
        return reconnected
