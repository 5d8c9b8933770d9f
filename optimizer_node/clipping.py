"""Global-norm clipping across nodes: once a node has summed every gradient of its buckets, it sends
its share of the squared norm to rank 0 (NORM_PARTIAL); rank 0 adds the shares in node order and sends
the total to every node (CLIP); each node computes the same coefficient and queues its updates. A
mixin of :class:`~optimizer_node.daemon.NodeDaemon`; runs on the daemon thread only.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from optimizer_node.adamw import clip_coefficient, sum_of_squares
from transport.wire import ErrorCode, Header, MsgType, WireError

if TYPE_CHECKING:
    import torch

    from optimizer_node.job_state import ActiveJob, BucketStep
    from optimizer_node.step_ledger import StepLedger
    from transport.interface import Message


class GlobalNormClipping:
    """NORM_PARTIAL out, CLIP in."""

    # State owned by NodeDaemon, used here.
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
        if any(s.clip is not None for s in self._in_flight.values()):
            return  # the norm of this step is known; its updates are queued
        if len(self._in_flight) < len(job.owned) or not all(s.reduction.complete for s in self._in_flight.values()):
            return
        step = next(iter(self._in_flight.values())).step
        partial = 0.0
        for bucket_id in sorted(self._in_flight):
            grad = self._in_flight[bucket_id].reduction.result
            assert grad is not None
            grad.div_(job.spec.world_size)
            partial += sum_of_squares(grad)
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
        if not isinstance(total, float) or not total >= 0.0:
            raise WireError(ErrorCode.BAD_REQUEST, f"sum_of_squares must be a non-negative float, got {total!r}")
        max_norm = self.max_grad_norm
        assert max_norm is not None
        grad_norm, coefficient = clip_coefficient(total, max_norm)
        self._awaiting_clip = None
        self._norm_partial = None
        for bucket_id, in_flight in self._in_flight.items():
            in_flight.clip, in_flight.grad_norm = coefficient, grad_norm
            heapq.heappush(self._ready, bucket_id)
