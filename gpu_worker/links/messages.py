"""What a worker's optimizer nodes send it, each message to its place.

:class:`NodeMessages` is the receive loop's ``dispatch`` (:mod:`gpu_worker.links.receive_loop`): PARAMS (a
batch of them cut back into one message per bucket) go to the handler of the :class:`ParamsRoute`; NOTICEs are
news or logged; a CONSUMED acknowledges a layer-wise push; rank 0 answers the nodes' norm shares of a
clipped step, whatever it was waiting for; an ERROR raises :class:`NodeError`, unless it is a refusal of
this rank's gradient that the open step collects. It also keeps the PULLs not answered yet (asked
again of a node that restarts) and words a timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gpu_worker.links.connections import NodeConnections, NonFiniteGradientError, node_error
from gpu_worker.links.norm_totals import NormTotals
from transport.batches import split_batch
from transport.interface import Message
from transport.wire import Header, MsgType, WireError

if TYPE_CHECKING:
    from gpu_worker.exchange.push_pacing import PushPacer
    from gpu_worker.links.news import NodeNews
    from gpu_worker.links.rank_state import RankState
    from gpu_worker.links.refusals import RefusedGradients


class ParamsRoute:
    """Where the nodes' PARAMS go: ``handler(node_index, message)``, set by whatever awaits values at
    the moment (full mode's awaited values, the layer-wise streamer, a push waiting for room in the
    window); ``None`` while nothing does, when a PARAMS is unexpected."""

    def __init__(self) -> None:
        self.handler: Callable[[int, Message], None] | None = None


class NodeMessages:
    """Hands each message from the nodes on, and keeps what this worker asked for.

    ``requests``: bucket -> the step asked for with PULL, not arrived yet; ``norm_totals``: rank 0's
    totals of the nodes' norm shares; ``batching_nodes``: the nodes that may send several buckets in
    one message (registration keeps it); ``collect_refusal(error)``: whether the open step collects a
    refusal of this rank's gradient instead of raising it now; ``pacer`` (acknowledged by
    ``pacer_ack``): the push window, if any; ``timeout_s``: the wait a timeout's message names."""

    def __init__(
        self,
        state: RankState,
        connections: NodeConnections,
        news: NodeNews,
        refusals: RefusedGradients,
        batching_nodes: set[int],
        *,
        route: ParamsRoute,
        pacer: PushPacer | None,
        pacer_ack: MsgType,
        timeout_s: float,
        collect_refusal: Callable[[NonFiniteGradientError], bool],
    ) -> None:
        self._state = state
        self._route = route
        self._pacer = pacer
        self._pacer_ack = pacer_ack
        self._timeout_s = timeout_s
        self._connections = connections
        self._news = news
        self._refusals = refusals
        self._batching_nodes = batching_nodes
        self._collect_refusal = collect_refusal
        self.requests: dict[int, int] = {}
        self.norm_totals = NormTotals()

    def request(self, bucket_id: int, at_step: int) -> None:
        """Ask the bucket's node for its values of ``at_step`` (PULL); the node answers once the bucket is there."""
        state = self._state
        bucket = state.buckets[bucket_id]
        self.requests[bucket_id] = at_step
        self._connections.send(bucket.node, Header(msg_type=MsgType.PULL, rank=state.rank, bucket_id=bucket_id, meta={"at_step": at_step}))

    def dispatch(self, index: int, message: Message) -> None:
        """Handle one message from node ``index``."""
        state = self._state
        header = message.header
        if header.msg_type == MsgType.ERROR:
            error = node_error(state.nodes[index], header)
            if isinstance(error, NonFiniteGradientError):
                if self._collect_refusal(error):
                    return
                error = NonFiniteGradientError(state.rank, error.refusals, state.describe_bucket, retry=False)
            raise error
        if header.msg_type == MsgType.NOTICE:
            if self._news.on_notice(state.nodes[index], header, state.rank):
                return
            self._connections.log_notice(index, header)
            refused = header.meta.get("non_finite")
            if isinstance(refused, dict) and all(isinstance(refused.get(key), int) for key in ("bucket", "step", "rank")):
                self._refusals.note_blocked(refused["bucket"], refused["step"], refused["rank"])
            return
        if header.msg_type == MsgType.CONSUMED:
            if self._pacer is not None and self._pacer_ack == MsgType.CONSUMED:
                self._pacer.returned(header.bucket_id)
            return
        if header.msg_type == MsgType.NORM_PARTIAL:
            self.norm_totals.on_share(index, header, sorted({b.node for b in state.buckets}), self._connections.send, state.rank)
            return
        if header.msg_type != MsgType.PARAMS or self._route.handler is None:
            raise RuntimeError(f"unexpected {header.msg_type.name} from node {state.nodes[index]}")
        if "batch" in header.meta:
            if index not in self._batching_nodes:
                raise RuntimeError(f"node {state.nodes[index]} sent a batch of buckets, which this worker did not ask it for")
            try:
                parts = split_batch(message)
            except WireError as exc:
                raise RuntimeError(f"node {state.nodes[index]} sent a malformed batch: {exc.message}") from None
            for part in parts:
                self._on_params(index, part)
            return
        self._on_params(index, message)

    def _on_params(self, index: int, message: Message) -> None:
        state = self._state
        header = message.header
        self._news.on_params(index, header, state.rank)
        if self.requests.get(header.bucket_id) == header.step:
            del self.requests[header.bucket_id]
        if self._pacer is not None and self._pacer_ack == MsgType.PARAMS:
            self._pacer.returned(header.bucket_id)
        handler = self._route.handler
        assert handler is not None  # dispatch checked it before the batch was cut
        handler(index, message)

    def diagnose_timeout(self, missing: str) -> str:
        """The timeout's message: what this worker misses and, per node, what the node waits for."""
        state = self._state
        refused = self._refusals.accounts(since_step=state.step - 1)  # layer-wise: pushed buckets are counted a step ahead
        return "; ".join([f"rank {state.rank}, step {state.step}: {missing} after {self._timeout_s:.0f} s", *refused, *self._connections.accounts()])
