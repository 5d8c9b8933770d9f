"""Where a bucket goes once every rank's gradient of its step is in: :class:`RoundGate`, one a job.

Without a global round its update is ready at once. With one (clipping's global gradient norm, or
the agreement to skip a step with a non-finite gradient: :mod:`optimizer_node.update.clipping`) every
bucket of the step waits for it: once all are summed, this node sends its share of the norm to
rank 0, whose CLIP queues them all. A paused node sends its share once resumed; a rank 0 on a new
connection is sent it again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from transport.interface import Message
from transport.wire import Header

if TYPE_CHECKING:
    from optimizer_node.admin.operator import NodeOperator
    from optimizer_node.config import NodeConfig
    from optimizer_node.intake.registration import JobRegistrar
    from optimizer_node.intake.step_ledger import StepLedger
    from optimizer_node.job_state import ActiveJob, BucketStep
    from optimizer_node.serving.delivery import BucketDelivery
    from optimizer_node.update.clipping import GlobalNormRound
    from optimizer_node.update.queue import UpdateQueue


class GatedNode(Protocol):
    """What the gate reads of its node at each call (each may change while the job runs)."""

    @property
    def ledger(self) -> StepLedger: ...

    config: NodeConfig
    operator: NodeOperator


class RoundGate:
    """The job's complete buckets into the update queue, or through the step's global round.

    ``in_flight``: the job's steps in flight by bucket (the intake's); ``send``: how a message goes
    out."""

    def __init__(
        self,
        node: GatedNode,
        norm_round: GlobalNormRound,
        registrar: JobRegistrar,
        in_flight: dict[int, BucketStep],
        updates: UpdateQueue,
        delivery: BucketDelivery,
        send: Callable[[bytes, Header], None],
    ) -> None:
        self._node = node
        self._norm_round = norm_round
        self._registrar = registrar
        self._in_flight = in_flight
        self._updates = updates
        self._delivery = delivery
        self._send = send

    @property
    def waits(self) -> bool:
        """Whether a step's updates wait for the round across all buckets and nodes: for the global
        gradient norm (clipping), or for the agreement to skip a step with a non-finite gradient."""
        return self._node.operator.max_grad_norm is not None or self._node.config.non_finite == "skip"

    def gradients_complete(self, job: ActiveJob, bucket_id: int, step: int) -> None:
        """Every rank's gradient of ``bucket_id`` at ``step`` is in: its update is ready, or waits for
        the step's global round."""
        if self.waits:
            self._delivery.tell_consumed(job, bucket_id, step)  # the round holds every sum until the norm is known
            self.request_norm(job)
        else:
            self._updates.push(bucket_id)

    def request_norm(self, job: ActiveJob) -> None:
        """Once every owned bucket's gradient is summed, send this node's share of the norm to rank 0."""
        operator = self._node.operator
        if operator.pause_reason is None and self._norm_round.share(job, self._in_flight, operator.max_grad_norm) is not None:  # else resume() asks again
            self.resend_share()

    def resend_share(self) -> None:
        """This node's share again, to rank 0's connection of now (if one went out)."""
        self._norm_round.resend(self._node.ledger.peer(0), self._send)

    def on_clip(self, message: Message) -> None:
        """Rank 0's total of the shares: the step's buckets are queued (or the step is skipped)."""
        self._registrar.require_rank(message)
        self._norm_round.on_clip(message.header, self._in_flight, self._updates.ready, self._node.operator.max_grad_norm)
