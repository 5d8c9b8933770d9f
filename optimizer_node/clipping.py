"""Global-norm clipping across nodes: once a node has summed every gradient of its buckets, it sends
its share of the squared norm to rank 0 (NORM_PARTIAL); rank 0 adds the shares in node order and sends
the total to every node (CLIP); each node computes the same coefficient and queues its updates. A
mixin of :class:`~optimizer_node.daemon.NodeDaemon`; runs on the daemon thread only.

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

from optimizer_node.adamw import clip_coefficient, sum_of_squares
from transport.wire import ErrorCode, Header, MsgType, WireError

if TYPE_CHECKING:
    import torch

    from optimizer_node.config import NodeConfig
    from optimizer_node.job_state import ActiveJob, BucketStep
    from optimizer_node.non_finite import NonFiniteStats
    from optimizer_node.step_ledger import StepLedger
    from transport.interface import Message

log = logging.getLogger(__name__)


class GlobalNormClipping:
    """NORM_PARTIAL out, CLIP in."""

    # State owned by NodeDaemon, used here.
    config: NodeConfig
    non_finite: NonFiniteStats
    _in_flight: dict[int, BucketStep]
    _ready: list[int]
    _awaiting_clip: int | None
    _pause_reason: str | None
    _ledger: StepLedger
    _norm_partial: Header | None  # the NORM_PARTIAL of the step awaiting its norm (sent again to a restarted rank 0)

    if TYPE_CHECKING:  # provided by NodeDaemon

        @property
        def max_grad_norm(self) -> float | None: ...
        def _require_rank(self, message: Message) -> ActiveJob: ...
        def _send(self, peer: bytes, header: Header, payload: torch.Tensor | None = None) -> None: ...

    def _maybe_request_norm(self, job: ActiveJob) -> None:
        """Once every owned bucket's gradient is summed, send this node's share of the norm to rank 0."""
        if self._pause_reason is not None or self._awaiting_clip is not None:
            return  # resume() asks again
        if any(s.agreed for s in self._in_flight.values()):
            return  # the norm of this step is known; its updates are queued
        if len(self._in_flight) < len(job.owned) or not all(s.reduction.complete for s in self._in_flight.values()):
            return
        step = next(iter(self._in_flight.values())).step
        partial = 0.0
        if self.max_grad_norm is not None:
            for bucket_id in sorted(self._in_flight):
                grad = self._in_flight[bucket_id].reduction.result
                assert grad is not None
                grad.div_(job.spec.workers)
                partial += sum_of_squares(grad)
        if any(s.non_finite for s in self._in_flight.values()) and math.isfinite(partial):
            partial = math.inf  # skip policy: a non-finite total makes every node skip the step
        self._awaiting_clip = step
        self._norm_partial = Header(msg_type=MsgType.NORM_PARTIAL, step=step, meta={"sum_of_squares": partial, "node_index": job.node_index})
        self._send_norm_partial()

    def _send_norm_partial(self) -> None:
        """To rank 0's current incarnation (again, when rank 0 restarted while the node waited for it)."""
        peer = self._ledger.peer(0)
        if self._awaiting_clip is not None and self._norm_partial is not None and peer is not None:
            self._send(peer, self._norm_partial)

    def _on_clip(self, message: Message) -> None:
        self._require_rank(message)
        header = message.header
        total = header.meta.get("sum_of_squares")
        if header.rank != 0 or self._awaiting_clip is None or header.step != self._awaiting_clip:
            raise WireError(ErrorCode.BAD_REQUEST, f"no gradient norm expected for step {header.step} from rank {header.rank}")
        skip_policy = self.config.non_finite == "skip"
        if not isinstance(total, float) or not (total >= 0.0 or (skip_policy and math.isnan(total))):
            raise WireError(ErrorCode.BAD_REQUEST, f"sum_of_squares must be a non-negative float, got {total!r}")
        max_norm = self.max_grad_norm
        skip = skip_policy and not math.isfinite(total)
        coefficient = None
        if skip:
            grad_norm = math.sqrt(total) if max_norm is not None else None  # nan or inf, as clip_grad_norm_ reports it
            self._step_skipped(header.step)
        elif max_norm is not None:
            grad_norm, coefficient = clip_coefficient(total, max_norm)
        else:  # skip policy without clipping: the total only said that every gradient is finite
            grad_norm = None
        self._awaiting_clip = None
        self._norm_partial = None
        for bucket_id, in_flight in self._in_flight.items():
            in_flight.clip, in_flight.grad_norm, in_flight.agreed, in_flight.skip = coefficient, grad_norm, True, skip
            heapq.heappush(self._ready, bucket_id)

    def _step_skipped(self, step: int) -> None:
        """Count and say that ``step`` is skipped, naming the culprit when this node saw it."""
        culprits = sorted((bucket_id, rank, values) for bucket_id, s in self._in_flight.items() for rank, values in s.non_finite.items())
        bucket_id, rank, values = culprits[0] if culprits else (-1, -1, 0)
        self.non_finite.skipped(step, rank, bucket_id, values)
        where = (
            "; ".join(f"rank {r}'s gradient of bucket {b} holds {v} NaN/inf value(s)" for b, r, v in culprits)
            if culprits
            else "a gradient another node received is not finite"
        )
        log.warning("step %d skipped on every bucket (--non-finite skip): %s; parameters, moments and the AdamW step count stay as they were", step, where)
