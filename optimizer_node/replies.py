"""How a node sends parameters: PULL answered now or once the bucket reaches the step asked for
(layer-wise workers ask just in time; rank 0's initial values release the first pulls), in the wire
dtype. A mixin of :class:`~optimizer_node.daemon.NodeDaemon`; runs on the daemon thread only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from optimizer_node.config import NodeConfig
from optimizer_node.memory_plan import available_memory, node_needs
from optimizer_node.params_outbox import ParamsOutbox
from optimizer_node.storage import BucketState, BucketStore
from transport.shm_board import board_bytes
from transport.wire import WIRE_DTYPES, ErrorCode, Header, MsgType, WireError, tensor_header

if TYPE_CHECKING:
    from job.placement import BucketSpec
    from optimizer_node.job_state import ActiveJob
    from optimizer_node.step_ledger import StepLedger
    from transport.interface import Message, ServerEndpoint

log = logging.getLogger(__name__)


class ParameterReplies:
    """PULL and PARAMS."""

    # State owned by NodeDaemon, used here.
    config: NodeConfig
    _store: BucketStore
    _deferred_pulls: dict[int, list[tuple[bytes, int]]]
    _ledger: StepLedger
    _outbox: ParamsOutbox
    _batching_peers: frozenset[bytes]
    _endpoint: ServerEndpoint
    same_host_address: str | None

    if TYPE_CHECKING:  # provided by NodeDaemon

        def _require_job(self) -> ActiveJob: ...
        def _require_rank(self, message: Message) -> ActiveJob: ...
        def _owned_bucket(self, job: ActiveJob, header: Header) -> BucketSpec: ...
        def _send(self, peer: bytes, header: Header, payload: torch.Tensor | None = None, *, published: tuple[int, tuple[int, int]] | None = None) -> None: ...
        def _flush_outbox(self, peer: bytes | None = None) -> None: ...

    def _on_pull(self, message: Message) -> None:
        """PARAMS now, or once the bucket exists (rank 0 initializes it) and reached ``at_step``.

        Without ``at_step`` the bucket's current values are sent. A PULL for the step before the
        bucket's is answered with the values the ledger kept for a restarted rank; for an older step
        (or when they are gone) it is STALE_STEP; one for a step more than one ahead is FUTURE_STEP (no
        worker can have pushed the gradient that would bring the bucket there)."""
        job = self._require_rank(message)
        header = message.header
        bucket = self._owned_bucket(job, header)
        at_step = header.meta.get("at_step")
        if at_step is not None and (not isinstance(at_step, int) or isinstance(at_step, bool) or at_step < 0):
            raise WireError(ErrorCode.BAD_REQUEST, f"at_step must be a non-negative integer, got {at_step!r}")
        state = self._store.get(bucket.bucket_id)
        current = job.base_step if state is None else state.step  # a bucket without values yet starts at the job's base step
        if at_step is not None and at_step < current:
            kept = self._ledger.retained(bucket.bucket_id, at_step)
            if kept is not None:  # a copy: the ledger reuses its buffers, the send reads without copying
                payload = kept.clone()
                self._send(message.peer, tensor_header(MsgType.PARAMS, payload, self.config.chunk_bytes, step=at_step, bucket_id=bucket.bucket_id), payload)
                return
            raise WireError(ErrorCode.STALE_STEP, f"bucket {bucket.bucket_id} is at step {current}; its values of step {at_step} are gone")
        if at_step is not None and at_step > current + 1:
            raise WireError(ErrorCode.FUTURE_STEP, f"bucket {bucket.bucket_id} is at step {current}; step {at_step} is more than one update ahead")
        if state is None or (at_step is not None and at_step > current):  # answered once it gets there
            waiting = self._deferred_pulls.setdefault(bucket.bucket_id, [])
            entry = (message.peer, current if at_step is None else at_step)
            if entry not in waiting:  # asked again: answered once anyway, and the list stays a few entries per rank
                waiting.append(entry)
            return
        self._send_params(state, [message.peer])

    def _answer_deferred_pulls(self, state: BucketState, meta: dict | None = None) -> list[bytes]:
        """Send the bucket to whoever asked for its values of a step it has reached; returns them."""
        waiting = self._deferred_pulls.pop(state.bucket_id, [])
        due = list(dict.fromkeys(peer for peer, step in waiting if step <= state.step))  # a peer that asked twice gets it once
        later = [(peer, step) for peer, step in waiting if step > state.step]
        if later:
            self._deferred_pulls[state.bucket_id] = later
        if due:
            self._send_params(state, due, meta)
        return due

    def _batched_to(self, peer: bytes, state: BucketState, meta: dict, payload: torch.Tensor | None) -> bool:
        """Queue the bucket's values for ``peer`` in its batch, if it takes batches (a full batch
        leaves at once); False where they must be sent alone."""
        if peer not in self._batching_peers:
            return False
        if self._outbox.add(peer, state, meta, payload):
            self._flush_outbox(peer)
        return True

    def _send_params(self, state: BucketState, peers: list[bytes], meta: dict | None = None, *, batched: bool = False) -> None:
        """The bucket's current values to ``peers``; ``batched``: small ones may wait in the outbox for
        the other buckets updated meanwhile, for the peers that take batches."""
        job = self._require_job()
        params = self._store.params_for_send(state)  # out of core: only the parameter third is read
        if job.spec.wire_dtype == "float32":
            payload = params
        elif params is state.param:
            if state.wire_copy is None:
                state.wire_copy = torch.empty(state.numel, dtype=WIRE_DTYPES[job.spec.wire_dtype])
                state.wire_step = -1
            payload = state.wire_copy
            if state.wire_step != state.step:  # the update pass cast it already for this step
                payload.copy_(params)
                state.wire_step = state.step
        else:
            payload = params.to(WIRE_DTYPES[job.spec.wire_dtype])
        batched = batched and self._outbox.takes(payload)
        header = None
        version = (state.bucket_id, (state.revision, state.step))  # what the board holds for it, if it has it
        for peer in peers:
            if batched and self._batched_to(peer, state, meta or {}, payload):
                continue
            if header is None:
                header = tensor_header(MsgType.PARAMS, payload, self.config.chunk_bytes, step=state.step, bucket_id=state.bucket_id, meta=meta or {})
            self._send(peer, header, payload, published=version)

    def _publish_board(self, job: ActiveJob) -> None:
        """A parameter board for this job's values (same-host workers read them there), where the
        node keeps its state in memory and the host's available memory holds one more copy."""
        self._endpoint.drop_board()
        if not self.config.same_host_board or self.config.state_dir is not None or not self.same_host_address:
            return
        wire_bytes = WIRE_DTYPES[job.spec.wire_dtype].itemsize
        sizes = [bucket.numel * wire_bytes for bucket in job.owned.values()]
        params = sum(bucket.numel for bucket in job.owned.values())
        needs = node_needs(params, workers=job.spec.world_size, wire_bytes=wire_bytes, layerwise=job.spec.mode == "layerwise", board=True)
        available = available_memory()
        if available is not None and needs.ram_in_memory > available:
            log.info(
                "no parameter board: this node's share with it needs about %.1f GiB and %.1f GiB are available", needs.ram_in_memory / 2**30, available / 2**30
            )
            return
        if self._endpoint.publish_board(board_bytes(sizes)):
            log.info("same-host workers read parameters from a board of %.1f MiB", board_bytes(sizes) / 2**20)
