"""What goes out when a bucket reaches its next step.

In full mode the new values go to every rank of the job (those that asked for them with a PULL are
answered first, once only); in layer-wise mode to the ranks that asked for that bucket at that step,
in the order they asked, and the ranks are told the bucket's gradients no longer take memory here
(CONSUMED). A bucket whose every rank pushed no gradient (a frozen layer) did not change: only its
step goes out. The last owned bucket to reach a step ends the step on the node; when a checkpoint is
due then, it is written before those values go out, so a node killed in between comes back at the
step its workers are still in, never behind them.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from transport.wire import Header, MsgType

if TYPE_CHECKING:
    from optimizer_node.control import StepClock
    from optimizer_node.faults import CrashPoints
    from optimizer_node.job_state import ActiveJob, BucketStep, CurrentJob
    from optimizer_node.metrics import NodeMetrics
    from optimizer_node.serving.outgoing import Outgoing
    from optimizer_node.serving.replies import ParameterReplies
    from optimizer_node.state.persistence import Checkpoints
    from optimizer_node.state.storage import BucketState
    from optimizer_node.step_end import StepEnd

log = logging.getLogger(__name__)


class BucketDelivery:
    """One job's updated buckets out, and the count of the owned buckets that reached each step.

    ``current``: where the job stands (its ranks; its steps in flight, let go of here); ``step_end``:
    what the node does once every owned bucket reached a step."""

    def __init__(
        self,
        current: CurrentJob,
        replies: ParameterReplies,
        outgoing: Outgoing,
        checkpoints: Checkpoints,
        clock: StepClock,
        metrics: NodeMetrics,
        crash_points: CrashPoints,
        step_end: StepEnd,
    ) -> None:
        self._current = current
        self._in_flight = current.in_flight
        self._replies = replies
        self._outgoing = outgoing
        self._checkpoints = checkpoints
        self._clock = clock
        self._metrics = metrics
        self._crash_points = crash_points
        self._step_end = step_end
        self._done: dict[int, int] = {}  # step -> owned buckets that reached it (the step not ended yet)

    def clear(self) -> None:
        """Forget the counts (the job changes its width: what the old width sent of a step is dropped)."""
        self._done.clear()

    def deliver(self, job: ActiveJob, state: BucketState, in_flight: BucketStep, unchanged: bool) -> None:
        """The bucket reached its next step: its new values out (to every rank in full mode, to those
        that asked in layer-wise mode), the step's end when it was the last owned bucket."""
        del self._in_flight[state.bucket_id]
        sending = time.perf_counter()
        step = state.step
        done = self._done.get(step, 0) + 1
        ends_step = done == len(job.owned)
        if ends_step:
            self._done.pop(step, None)
        checkpointed_first = ends_step and self._checkpoints.due(step)
        if checkpointed_first:
            self._step_end.finish(step)  # checkpointed before the values that end the step go out
        meta: dict = {} if in_flight.grad_norm is None else {"grad_norm": in_flight.grad_norm}
        if in_flight.skip:
            meta["skipped"] = True
        replies = self._replies
        if job.spec.mode == "full":  # everyone gets the new values; once only who also asked for them
            answered = replies.answer_deferred(state, job, meta)
            others = [peer for peer in self._current.ledger.connections() if peer not in answered]
            if unchanged:  # the workers hold these values already: only the step goes out
                unchanged_meta = {**meta, "unchanged": True}
                for peer in others:
                    if not replies.batched_to(peer, state, unchanged_meta, None):
                        self._outgoing.send(peer, Header(msg_type=MsgType.PARAMS, step=step, bucket_id=state.bucket_id, meta=unchanged_meta))
            else:
                replies.send_params(state, job, others, meta, batched=True)
        else:
            if not in_flight.agreed:  # after a global round, CONSUMED went out when the bucket's gradients were complete
                self.tell_consumed(job, state.bucket_id, in_flight.step)
            replies.answer_deferred(state, job, meta)
        self._clock.current.send_s += time.perf_counter() - sending
        self._metrics.bucket_updated(time.perf_counter() - in_flight.first_arrival, ends_step=ends_step)
        if not ends_step:
            self._done[step] = done
            self._crash_points.passed("update")
        elif not checkpointed_first:
            self._step_end.finish(step)
        if log.isEnabledFor(logging.DEBUG):  # a bucket's hot path: not even the arguments otherwise
            log.debug(
                "bucket %d step %d applied %.1f ms after its first gradient", state.bucket_id, step, 1e3 * (time.perf_counter() - in_flight.first_arrival)
            )

    def tell_consumed(self, job: ActiveJob, bucket_id: int, step: int) -> None:
        """Layer-wise flow control: the ranks' gradients of this bucket no longer take memory here."""
        if job.spec.mode == "layerwise":
            for peer in self._current.ledger.connections():
                self._outgoing.send(peer, Header(msg_type=MsgType.CONSUMED, bucket_id=bucket_id, step=step))
