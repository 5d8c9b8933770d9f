"""A worker's push window: at most so many gradient bytes pushed and not yet acknowledged.

Layer-wise workers acknowledge a push by the node's CONSUMED (a slow node, out of core, is never
flooded). Paced full-model workers, pushing during backward, by the bucket's new values:

Why: the ranks' flows into one node share that node's link, and TCP does not share it evenly. A node
can send a bucket's new values only once every rank's gradient of it is in, so when one rank's flow
runs ahead of another's, the buckets complete in a bunch at the end and the node's outgoing direction
idles until then. With a window, a rank that runs ahead waits for the values of its oldest buckets,
which come once the slower ranks have caught up: the ranks' flows move in step, buckets complete all
through the step, and both directions of the node's link carry data at once.

Values that come back while a push waits for room are kept (the frames as received) and installed
with the rest of the step's values in ``finish_step``: nothing changes a parameter during backward.
"""

from __future__ import annotations

from collections.abc import Callable

from transport.interface import Message


class PushPacer:
    """The window's bookkeeping for one worker session: bytes in flight and values kept for later."""

    def __init__(self, window_bytes: int) -> None:
        if window_bytes <= 0:
            raise ValueError(f"the push window must be positive, got {window_bytes} bytes")
        self.window_bytes = window_bytes
        self._in_flight: dict[int, int] = {}  # bucket -> gradient bytes pushed, values not back yet
        self._in_flight_bytes = 0
        self._kept: list[tuple[int, Message]] = []  # (node index, PARAMS) that came while a push waited
        self.waits = 0
        """Pushes that waited for room, since the optimizer was made."""
        self.kept_total = 0
        """Values kept for ``finish_step``, since the optimizer was made."""

    @property
    def in_flight_bytes(self) -> int:
        return self._in_flight_bytes

    def has_room(self, nbytes: int) -> bool:
        """Whether a push of ``nbytes`` fits (a lone push always does, whatever its size)."""
        return not self._in_flight or self._in_flight_bytes + nbytes <= self.window_bytes

    def pushed(self, bucket_id: int, nbytes: int) -> None:
        """The bucket's gradient went out (again, to a node that restarted: counted once)."""
        self._in_flight_bytes += nbytes - self._in_flight.get(bucket_id, 0)
        self._in_flight[bucket_id] = nbytes

    def returned(self, bucket_id: int) -> None:
        """The bucket's new values arrived (or the node said they are unchanged)."""
        self._in_flight_bytes -= self._in_flight.pop(bucket_id, 0)

    def keep(self, node_index: int, message: Message) -> None:
        """Values that came while a push waited for room: installed at ``finish_step``."""
        self._kept.append((node_index, message))
        self.kept_total += 1

    def replay(self, install: Callable[[int, Message], None]) -> None:
        """Hand the kept values to ``install`` in the order they came, and forget them."""
        kept, self._kept = self._kept, []
        for node_index, message in kept:
            install(node_index, message)

    def clear(self) -> None:
        """The step is over: nothing is in flight and nothing is kept."""
        self._in_flight.clear()
        self._in_flight_bytes = 0
        self._kept.clear()
