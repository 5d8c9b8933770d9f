"""Where a bucket goes once every rank's gradient of its step is in: :class:`RoundGate`, one a job.

Without a global round its update is ready at once. With one (clipping's global gradient norm, or
the agreement to skip a step with a non-finite gradient: :mod:`optimizer_node.update.clipping`) every
bucket of the step waits for it: once all are summed, this node sends its share of the norm to
rank 0, whose CLIP queues them all. A paused node sends its share once resumed; a rank 0 on a new
connection is sent it again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from transport.interface import Message
from transport.wire import Header

if TYPE_CHECKING:
    from optimizer_node.intake.rank_check import RankCheck
    from optimizer_node.job_state import ActiveJob, CurrentJob
    from optimizer_node.serving.delivery import BucketDelivery
    from optimizer_node.update.clipping import GlobalNormRound
    from optimizer_node.update.queue import UpdateQueue


class RoundGate:
    """The job's complete buckets into the update queue, or through the step's global round.

    ``current``: where the job stands (its ranks, its steps in flight); ``ranks``: who may send what;
    ``send``: how a message goes out; ``paused``: whether an operator holds the updates;
    ``max_grad_norm``: the clipping threshold in force; ``skip_policy``: a step with a non-finite
    gradient is skipped on every node (``--non-finite skip``)."""

    def __init__(
        self,
        current: CurrentJob,
        norm_round: GlobalNormRound,
        ranks: RankCheck,
        updates: UpdateQueue,
        delivery: BucketDelivery,
        send: Callable[[bytes, Header], None],
        *,
        paused: Callable[[], bool],
        max_grad_norm: Callable[[], float | None],
        skip_policy: bool,
    ) -> None:
        self._current = current
        self._norm_round = norm_round
        self._ranks = ranks
        self._in_flight = current.in_flight
        self._paused = paused
        self._max_grad_norm = max_grad_norm
        self._skip_policy = skip_policy
        self._updates = updates
        self._delivery = delivery
        self._send = send

    @property
    def waits(self) -> bool:
        """Whether a step's updates wait for the round across all buckets and nodes: for the global
        gradient norm (clipping), or for the agreement to skip a step with a non-finite gradient."""
        return self._max_grad_norm() is not None or self._skip_policy

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
        if not self._paused() and self._norm_round.share(job, self._in_flight, self._max_grad_norm()) is not None:  # else resume() asks again
            self.resend_share()

    def resend_share(self) -> None:
        """This node's share again, to rank 0's connection of now (if one went out)."""
        self._norm_round.resend(self._current.ledger.peer(0), self._send)

    def on_clip(self, message: Message) -> None:
        """Rank 0's total of the shares: the step's buckets are queued (or the step is skipped)."""
        self._ranks.require_rank(message)
        self._norm_round.on_clip(message.header, self._in_flight, self._updates.ready, self._max_grad_norm())
