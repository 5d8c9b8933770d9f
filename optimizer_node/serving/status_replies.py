"""QUERY answered with STATUS: :class:`StatusReplies`, one a job.

A worker asks for its diagnosis (a wait that timed out, say). A connection that is not a registered
rank learns whether there is a job and that it is not part of it; a rank of the job learns where the
job is and what the node waits for: gradients, the global norm, initial values, an operator's
resume, a failing store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from optimizer_node.job_state import JobNode
from transport.interface import Message
from transport.wire import Header, MsgType

if TYPE_CHECKING:
    from optimizer_node.admin.operator import NodeOperator
    from optimizer_node.intake.gradients import GradientIntake
    from optimizer_node.intake.registration import JobRegistrar
    from optimizer_node.serving.outgoing import Outgoing
    from optimizer_node.state.storage import BucketStore
    from optimizer_node.update.clipping import GlobalNormRound
    from optimizer_node.update.queue import UpdateQueue


class QueriedNode(JobNode, Protocol):
    """What :class:`StatusReplies` reads of the daemon, besides :class:`JobNode`."""

    operator: NodeOperator


class StatusReplies:
    """The STATUS of one job's node, read from the job's parts."""

    def __init__(
        self,
        node: QueriedNode,
        registrar: JobRegistrar,
        outgoing: Outgoing,
        intake: GradientIntake,
        norm_round: GlobalNormRound,
        store: BucketStore,
        updates: UpdateQueue,
    ) -> None:
        self._node = node
        self._registrar = registrar
        self._outgoing = outgoing
        self._intake = intake
        self._norm_round = norm_round
        self._store = store
        self._updates = updates

    def on_query(self, message: Message) -> None:
        """A STATUS back to the connection that asked."""
        node = self._node
        job = node.active_job
        if not self._registrar.is_registered(message):
            # All a worker that is not (or no longer) registered needs for its diagnosis: is there a
            # job, and is this connection part of it. The job's state is for its ranks only.
            self._outgoing.send(message.peer, Header(msg_type=MsgType.STATUS, meta={"registered": job is not None, "rank_registered": False}))
            return
        missing = self._intake.missing()
        meta = {
            "node_id": node.node_id,
            "registered": job is not None,
            "step": node.step,
            "connected_ranks": sorted(node.ledger.ranks),
            "missing": missing,
            "awaiting_clip": self._norm_round.awaiting,
            "uninitialized": sorted(b for b in (job.owned if job else {}) if self._store.get(b) is None),
            "paused": node.operator.pause_reason,
            "storage_error": self._updates.storage_error,
        }
        self._outgoing.send(message.peer, Header(msg_type=MsgType.STATUS, step=node.step, meta=meta))
