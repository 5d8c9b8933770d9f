"""Global-norm clipping across nodes: once a node has summed every gradient of its buckets, it sends
its share of the squared norm to rank 0 (NORM_PARTIAL); rank 0 adds the shares in node order and sends
the total to every node (CLIP); each node computes the same coefficient and queues its updates.
:class:`GlobalNormRound` holds one node's side of the round (the step it waits for and the share it
sent); the daemon owns one per job and calls it on its thread only.

The same round is how the nodes agree to skip a step with a non-finite gradient (``--non-finite
skip``, GradScaler semantics): a node that received one sends an infinite share (NaN, too, comes out
of a clipped step's squares), so the total every node gets is not finite, and every node skips the
step on every bucket. Under the skip policy the round runs every step, with clipping or without;
without clipping the shares are 0.0 or inf and no gradient is summed or scaled for it.
"""

from __future__ import annotations

import heapq
import logging
import math
from typing import TYPE_CHECKING

from optimizer_node.update.adamw import clip_coefficient, sum_of_squares
from transport.wire import ErrorCode, Header, MsgType, WireError

if TYPE_CHECKING:
    from collections.abc import Callable

    from optimizer_node.intake.non_finite import NonFiniteStats
    from optimizer_node.job_state import ActiveJob, BucketStep

log = logging.getLogger(__name__)


class GlobalNormRound:
    """NORM_PARTIAL out, CLIP in: the step whose norm this node waits for and the share it sent.

    ``in_flight`` (bucket -> the step's summed gradients) and ``ready`` (the heap of buckets whose
    update may run) are the daemon's, passed in by each call; ``non_finite`` counts skipped steps."""

    def __init__(self, non_finite: NonFiniteStats, skip_policy: bool) -> None:
        self._non_finite = non_finite
        self._skip_policy = skip_policy  # --non-finite skip: the round runs every step
        self.awaiting: int | None = None  # the step whose share went out, until its CLIP comes
        self._partial: Header | None = None  # that share (sent again to a restarted rank 0)

    def reset(self) -> None:
        """Forget the round in progress (the job changed its width, or a new job)."""
        self.awaiting, self._partial = None, None

    def share(self, job: ActiveJob, in_flight: dict[int, BucketStep], max_grad_norm: float | None) -> Header | None:
        """This node's NORM_PARTIAL once every owned bucket's gradient is summed (averaged here, as
        the updates take them), for rank 0; ``None`` while some are missing, or when it went out."""
        if self.awaiting is not None or any(s.agreed for s in in_flight.values()):
            return None  # sent already; or the norm of this step is known and its updates are queued
        if len(in_flight) < len(job.owned) or not all(s.reduction.complete for s in in_flight.values()):
            return None
        step = next(iter(in_flight.values())).step
        partial = 0.0
        if max_grad_norm is not None:
            for bucket_id in sorted(in_flight):
                grad = in_flight[bucket_id].reduction.result
                assert grad is not None
                grad.div_(job.spec.workers)
                partial += sum_of_squares(grad)
        if any(s.non_finite for s in in_flight.values()) and math.isfinite(partial):
            partial = math.inf  # skip policy: a non-finite total makes every node skip the step
        self.awaiting = step
        self._partial = Header(msg_type=MsgType.NORM_PARTIAL, step=step, meta={"sum_of_squares": partial, "node_index": job.node_index})
        return self._partial

    def resend(self, rank0: bytes | None, send: Callable[[bytes, Header], None]) -> None:
        """The share again, to rank 0's current connection (rank 0 restarted while the node waited)."""
        if self.awaiting is not None and self._partial is not None and rank0 is not None:
            send(rank0, self._partial)

    def on_clip(self, header: Header, in_flight: dict[int, BucketStep], ready: list[int], max_grad_norm: float | None) -> None:
        """Rank 0's total: every bucket of the step gets its clip coefficient (or is skipped) and is
        queued in ``ready``. WireError for a CLIP nobody waits for or a malformed total."""
        total = header.meta.get("sum_of_squares")
        if header.rank != 0 or self.awaiting is None or header.step != self.awaiting:
            raise WireError(ErrorCode.BAD_REQUEST, f"no gradient norm expected for step {header.step} from rank {header.rank}")
        if not isinstance(total, float) or not (total >= 0.0 or (self._skip_policy and math.isnan(total))):
            raise WireError(ErrorCode.BAD_REQUEST, f"sum_of_squares must be a non-negative float, got {total!r}")
        skip = self._skip_policy and not math.isfinite(total)
        coefficient = None
        if skip:
            grad_norm = math.sqrt(total) if max_grad_norm is not None else None  # nan or inf, as clip_grad_norm_ reports it
            self._step_skipped(header.step, in_flight)
        elif max_grad_norm is not None:
            grad_norm, coefficient = clip_coefficient(total, max_grad_norm)
        else:  # skip policy without clipping: the total only said that every gradient is finite
            grad_norm = None
        self.reset()
        for bucket_id, step in in_flight.items():
            step.clip, step.grad_norm, step.agreed, step.skip = coefficient, grad_norm, True, skip
            heapq.heappush(ready, bucket_id)

    def _step_skipped(self, step: int, in_flight: dict[int, BucketStep]) -> None:
        """Count and say that ``step`` is skipped, naming the culprit when this node saw it."""
        culprits = sorted((bucket_id, rank, values) for bucket_id, s in in_flight.items() for rank, values in s.non_finite.items())
        bucket_id, rank, values = culprits[0] if culprits else (-1, -1, 0)
        self._non_finite.skipped(step, rank, bucket_id, values)
        where = (
            "; ".join(f"rank {r}'s gradient of bucket {b} holds {v} NaN/inf value(s)" for b, r, v in culprits)
            if culprits
            else "a gradient another node received is not finite"
        )
        log.warning("step %d skipped on every bucket (--non-finite skip): %s; parameters, moments and the AdamW step count stay as they were", step, where)
