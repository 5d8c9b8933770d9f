"""Rank 0's side of global-norm clipping (and of agreeing to skip a step with a NaN/inf gradient):
each node with buckets sends its share of the squared norm (NORM_PARTIAL); rank 0 adds the shares in
node order, so every run adds them the same way, and sends the total to those nodes (CLIP). A node
that restarted after the total went out asks again and gets the same total.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transport.wire import Header, MsgType

SendToNode = Callable[[int, Header], object]


class NormTotals:
    """The shares of the step in progress, and the last total sent (step, sum of squares)."""

    def __init__(self) -> None:
        self._shares: dict[int, float] = {}  # node index -> its share of the step in progress
        self._last: tuple[int, float] | None = None

    def forget(self) -> None:
        """The job changed its width: nothing of the old width's rounds is sent again."""
        self._shares.clear()
        self._last = None

    def on_share(self, index: int, header: Header, nodes_with_buckets: Sequence[int], send: SendToNode, rank: int) -> None:
        """Node ``index``'s share (``header``); once every node in ``nodes_with_buckets`` (ascending)
        sent one, the total goes to them all, from ``rank`` (this worker's)."""
        if self._last is not None and self._last[0] == header.step:  # asked again: the same total
            send(index, _clip(rank, header.step, self._last[1]))
            return
        self._shares[index] = float(header.meta["sum_of_squares"])
        if len(self._shares) == len(nodes_with_buckets):
            total = sum(self._shares[n] for n in nodes_with_buckets)  # node order: deterministic
            self._shares.clear()
            self._last = (header.step, total)
            for node in nodes_with_buckets:
                send(node, _clip(rank, header.step, total))


def _clip(rank: int, step: int, total: float) -> Header:
    return Header(msg_type=MsgType.CLIP, rank=rank, step=step, meta={"sum_of_squares": total})
