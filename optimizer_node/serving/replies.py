"""How a node sends parameters: PULL answered now or once the bucket reaches the step asked for
(layer-wise workers ask just in time; rank 0's initial values release the first pulls), in the wire
dtype; small buckets' new values in batches to the ranks that take them; the parameter board.
:class:`ParameterReplies` owns what that takes for one job (the waiting pulls, the ranks that take
batches, the outbox); the daemon composes one and calls it on its thread only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from optimizer_node.config import NodeConfig
from optimizer_node.serving.params_outbox import ParamsOutbox
from optimizer_node.state.memory_plan import available_memory, node_needs
from optimizer_node.state.storage import BucketState, BucketStore
from transport.shm.board import board_bytes
from transport.shm.window import shared_pages_said
from transport.wire import WIRE_DTYPES, ErrorCode, MsgType, WireError, tensor_header

if TYPE_CHECKING:
    from collections.abc import Callable

    from optimizer_node.intake.step_ledger import StepLedger
    from optimizer_node.job_state import ActiveJob
    from protos.job.placement import BucketSpec
    from transport.interface import Message, ServerEndpoint

    Send = Callable[..., None]  # the daemon's reply: (peer, header, payload=None, *, published=None)

log = logging.getLogger(__name__)


class ParameterReplies:
    """PULL and PARAMS for one job: pulls waiting for their step, the ranks that take batches of
    small buckets and the outbox those batches wait in, and the parameter board.

    ``send`` is the daemon's reply path (limits on outsiders, send handles kept on the bucket);
    ``sent_bytes`` counts what a batch sends; ``batch_params``: whether this node batches at all (an
    out-of-core node sends each bucket's values at once: its tensors go back to the store's pool)."""

    def __init__(
        self,
        config: NodeConfig,
        store: BucketStore,
        endpoint: ServerEndpoint,
        send: Send,
        sent_bytes: Callable[[int], None],
        *,
        same_host_address: str | None,
        batch_params: bool,
    ) -> None:
        self._config = config
        self._store = store
        self._endpoint = endpoint
        self._send = send
        self._sent_bytes = sent_bytes
        self._same_host_address = same_host_address
        self._batch_params = batch_params
        self.outbox = ParamsOutbox()  # new values of small buckets, leaving as one message per worker
        self._deferred: dict[int, list[tuple[bytes, int]]] = {}  # bucket -> (peer, step asked for)
        self._batching: dict[int, bytes] = {}  # rank -> its connection, for ranks that take batches
        self.batching_peers: frozenset[bytes] = frozenset()

    def forget_ranks(self) -> None:
        """The job's ranks are not the same any more (it changed its width): no pull waits, no rank
        takes batches until it says so again. Flush the outbox first."""
        assert not self.outbox, "the outbox leaves before its ranks are forgotten"
        self._deferred.clear()
        self._batching.clear()
        self.batching_peers = frozenset()

    def note_batching(self, rank: int, peer: bytes, asked: bool) -> bool:
        """A rank registered on ``peer``, asking for batches or not; returns whether it gets them."""
        if asked and self._batch_params:
            self._batching[rank] = peer
        else:
            self._batching.pop(rank, None)
        self.batching_peers = frozenset(self._batching.values())
        return asked and self._batch_params

    def flush(self, peer: bytes | None = None) -> None:
        """Send the batched new values waiting for ``peer`` (every peer: ``None``)."""
        for target in [peer] if peer is not None else self.outbox.peers():
            header, payload, states = self.outbox.take(target, self._config.chunk_bytes)
            try:
                handle = self._endpoint.send(target, header, payload)
            except ConnectionError as exc:
                log.warning("could not send PARAMS: %s", exc)
                continue
            self.outbox.sent(handle)
            self._sent_bytes(header.payload_bytes)
            for state in states:
                state.pending_sends.append(handle)

    def on_pull(self, message: Message, job: ActiveJob, bucket: BucketSpec, ledger: StepLedger) -> None:
        """PARAMS now, or once the bucket exists (rank 0 initializes it) and reached ``at_step``.

        Without ``at_step`` the bucket's current values are sent. A PULL for the step before the
        bucket's is answered with the values the ledger kept for a restarted rank; for an older step
        (or when they are gone) it is STALE_STEP; one for a step more than one ahead is FUTURE_STEP (no
        worker can have pushed the gradient that would bring the bucket there)."""
        header = message.header
        at_step = header.meta.get("at_step")
        if at_step is not None and (not isinstance(at_step, int) or isinstance(at_step, bool) or at_step < 0):
            raise WireError(ErrorCode.BAD_REQUEST, f"at_step must be a non-negative integer, got {at_step!r}")
        state = self._store.get(bucket.bucket_id)
        current = job.base_step if state is None else state.step  # a bucket without values yet starts at the job's base step
        if at_step is not None and at_step < current:
            kept = ledger.retained(bucket.bucket_id, at_step)
            if kept is not None:  # a copy: the ledger reuses its buffers, the send reads without copying
                payload = kept.clone()
                self._send(message.peer, tensor_header(MsgType.PARAMS, payload, self._config.chunk_bytes, step=at_step, bucket_id=bucket.bucket_id), payload)
                return
            raise WireError(ErrorCode.STALE_STEP, f"bucket {bucket.bucket_id} is at step {current}; its values of step {at_step} are gone")
        if at_step is not None and at_step > current + 1:
            raise WireError(ErrorCode.FUTURE_STEP, f"bucket {bucket.bucket_id} is at step {current}; step {at_step} is more than one update ahead")
        if state is None or (at_step is not None and at_step > current):  # answered once it gets there
            waiting = self._deferred.setdefault(bucket.bucket_id, [])
            entry = (message.peer, current if at_step is None else at_step)
            if entry not in waiting:  # asked again: answered once anyway, and the list stays a few entries per rank
                waiting.append(entry)
            return
        self.send_params(state, job, [message.peer])

    def answer_deferred(self, state: BucketState, job: ActiveJob, meta: dict | None = None) -> list[bytes]:
        """Send the bucket to whoever asked for its values of a step it has reached; returns them."""
        waiting = self._deferred.pop(state.bucket_id, [])
        due = list(dict.fromkeys(peer for peer, step in waiting if step <= state.step))  # a peer that asked twice gets it once
        later = [(peer, step) for peer, step in waiting if step > state.step]
        if later:
            self._deferred[state.bucket_id] = later
        if due:
            self.send_params(state, job, due, meta)
        return due

    def batched_to(self, peer: bytes, state: BucketState, meta: dict, payload: torch.Tensor | None) -> bool:
        """Queue the bucket's values for ``peer`` in its batch, if it takes batches (a full batch
        leaves at once); False where they must be sent alone."""
        if peer not in self.batching_peers:
            return False
        if self.outbox.add(peer, state, meta, payload):
            self.flush(peer)
        return True

    def send_params(self, state: BucketState, job: ActiveJob, peers: list[bytes], meta: dict | None = None, *, batched: bool = False) -> None:
        """The bucket's current values to ``peers``; ``batched``: small ones may wait in the outbox for
        the other buckets updated meanwhile, for the peers that take batches."""
        payload = self._payload(state, job)
        batched = batched and self.outbox.takes(payload)
        header = None
        version = (state.bucket_id, (state.revision, state.step))  # what the board holds for it, if it has it
        for peer in peers:
            if batched and self.batched_to(peer, state, meta or {}, payload):
                continue
            if header is None:
                header = tensor_header(MsgType.PARAMS, payload, self._config.chunk_bytes, step=state.step, bucket_id=state.bucket_id, meta=meta or {})
            self._send(peer, header, payload, published=version)

    def _payload(self, state: BucketState, job: ActiveJob) -> torch.Tensor:
        """The bucket's current values in the wire dtype, as they go out."""
        if not self._store.params_resident(state) and (on_board := self.board_values(job, state, state.step)) is not None:
            return on_board  # out of core with a board: the update put them there, and no file is read
        params = self._store.params_for_send(state)  # out of core: only the parameter third is read
        if job.spec.wire_dtype == "float32":
            return params
        if params is not state.param:
            return params.to(WIRE_DTYPES[job.spec.wire_dtype])
        if (on_board := self.board_values(job, state, state.step)) is not None:
            return on_board  # the update pass cast them onto the board: sent from there, no cast, no copy
        if state.wire_copy is None:
            state.wire_copy = torch.empty(state.numel, dtype=WIRE_DTYPES[job.spec.wire_dtype])
            state.wire_step = -1
        if state.wire_step != state.step:  # else the update pass cast it already for this step
            state.wire_copy.copy_(params)
            state.wire_step = state.step
        return state.wire_copy

    def board_slot(self, job: ActiveJob, state: BucketState) -> torch.Tensor | None:
        """Where the update pass may write the bucket's new values in place, in the wire dtype (a
        16-bit wire: the cast it makes anyway): its slot on the parameter board, where same-host ranks
        read it and the values do not leave in a batch (small buckets of a full-model job go out as
        copies); ``None`` otherwise. :meth:`board_written` once the values are there."""
        dtype = WIRE_DTYPES[job.spec.wire_dtype]
        nbytes = state.numel * dtype.itemsize
        if job.spec.mode == "full" and self.batching_peers and self.outbox.takes_bytes(nbytes):
            return None
        slot = self._endpoint.board_slot(state.bucket_id, nbytes)
        return slot.view(dtype) if slot is not None else None

    def board_values(self, job: ActiveJob, state: BucketState, step: int) -> torch.Tensor | None:
        """The bucket's values of ``step`` (its current revision) in the wire dtype where they lie on
        the board: the current slot, or after :meth:`board_slot` opened the other one, the slot before;
        what the node sends from, and keeps for a rank that restarts mid-step, without a copy. Valid
        until the bucket's next :meth:`board_slot` but one (the current) or its next (the one before)."""
        held = self._endpoint.board_held(state.bucket_id, (state.revision, step))
        return held.view(WIRE_DTYPES[job.spec.wire_dtype]) if held is not None else None

    def board_written(self, state: BucketState) -> None:
        """The update pass wrote the bucket's values of its current step into :meth:`board_slot`: the
        version :meth:`send_params` publishes, so sending it copies nothing."""
        self._endpoint.board_written(state.bucket_id, (state.revision, state.step))

    def publish_board(self, job: ActiveJob) -> None:
        """A parameter board for this job's values (same-host workers read them there), where the
        node is to have one (:attr:`NodeConfig.board_wanted`: by default where it keeps its state in
        memory) and the host's available memory holds it."""
        for state in self._store:  # master values on the board going away: back into memory of their own
            state.own_param()
        self._endpoint.drop_board()
        if not self._config.board_wanted or not self._same_host_address:
            return
        wire_bytes = WIRE_DTYPES[job.spec.wire_dtype].itemsize
        sizes = [bucket.numel * wire_bytes for bucket in job.owned.values()]
        params = sum(bucket.numel for bucket in job.owned.values())
        layerwise = job.spec.mode == "layerwise"
        needs = node_needs(
            params,
            workers=job.spec.world_size,
            wire_bytes=wire_bytes,
            layerwise=layerwise,
            memory_budget=self._config.memory_budget,
            board=True,
            masters_on_board=self._config.masters_on_board,
        )
        ram = needs.ram_out_of_core if needs.ram_out_of_core is not None else needs.ram_in_memory
        available = available_memory()
        if available is not None and ram > available:
            # asked for by name (--same-host-board): say so louder than when it is only the default
            level = logging.WARNING if self._config.same_host_board else logging.INFO
            log.log(level, "no parameter board: this node's share with it needs about %.1f GiB and %.1f GiB are available", ram / 2**30, available / 2**30)
            return
        # two slots a bucket, so the update writes each version beside the one before, which is then
        # what a restarted rank needs (no copy of it in the update pass, no kept 16-bit copy)
        nbytes = board_bytes(sizes * 2)
        if self._endpoint.publish_board(nbytes, slots_per_key=2):
            # in 4 KiB pages, workers fault the board in again every step (they drop its pages after use)
            log.info("same-host workers read parameters from a board of %.1f MiB, in %s", nbytes / 2**20, shared_pages_said())
