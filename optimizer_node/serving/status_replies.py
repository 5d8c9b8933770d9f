"""QUERY answered with STATUS: :class:`StatusReplies`, one a job.

A worker asks for its diagnosis (a wait that timed out, say). A connection that is not a registered
rank learns whether there is a job and that it is not part of it; a rank of the job learns where the
job is and what the node waits for: gradients, the global norm, initial values, an operator's
resume, a failing store.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from transport.interface import Message
from transport.wire import Header, MsgType

if TYPE_CHECKING:
    from optimizer_node.intake.gradients import GradientIntake
    from optimizer_node.intake.rank_check import RankCheck
    from optimizer_node.job_state import CurrentJob
    from optimizer_node.update.clipping import GlobalNormRound
    from optimizer_node.update.queue import UpdateQueue


class StatusReplies:
    """The STATUS of one job's node, read from the job's parts. ``send``: how a message goes out;
    ``pause_reason``: why an operator paused the updates (``None``: not paused)."""

    def __init__(
        self,
        node_id: str,
        current: CurrentJob,
        ranks: RankCheck,
        intake: GradientIntake,
        norm_round: GlobalNormRound,
        updates: UpdateQueue,
        *,
        send: Callable[[bytes, Header], None],
        pause_reason: Callable[[], str | None],
    ) -> None:
        self._node_id = node_id
        self._current = current
        self._ranks = ranks
        self._send = send
        self._intake = intake
        self._norm_round = norm_round
        self._updates = updates
        self._pause_reason = pause_reason

    def on_query(self, message: Message) -> None:
        """A STATUS back to the connection that asked."""
        current = self._current
        job = current.job
        if not self._ranks.is_registered(message):
            # All a worker that is not (or no longer) registered needs for its diagnosis: is there a
            # job, and is this connection part of it. The job's state is for its ranks only.
            self._send(message.peer, Header(msg_type=MsgType.STATUS, meta={"registered": job is not None, "rank_registered": False}))
            return
        missing = self._intake.missing()
        meta = {
            "node_id": self._node_id,
            "registered": job is not None,
            "step": current.step,
            "connected_ranks": sorted(current.ledger.ranks),
            "missing": missing,
            "awaiting_clip": self._norm_round.awaiting,
            "uninitialized": sorted(b for b in (job.owned if job else {}) if current.store.get(b) is None),
            "paused": self._pause_reason(),
            "storage_error": self._updates.storage_error,
        }
        self._send(message.peer, Header(msg_type=MsgType.STATUS, step=current.step, meta=meta))
