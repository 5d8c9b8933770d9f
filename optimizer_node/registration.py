"""How a node takes a job: HELLO registers it (rank 0 first; other ranks wait for it), checks that
every worker describes the same job and that this node can hold its share; INIT stores rank 0's
initial values. The checks every later message goes through (a registered rank on its own
connection, a bucket this node owns, the payload's dtype and size) live here too. A mixin of
:class:`~optimizer_node.daemon.NodeDaemon`; runs on the daemon thread only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from optimizer_node.config import NodeConfig
from optimizer_node.job import JobSpec
from optimizer_node.job_state import ActiveJob, BucketStep
from optimizer_node.memory_plan import STATE_BYTES_PER_PARAM, fit_problem, node_needs
from optimizer_node.placement import BucketSpec
from optimizer_node.step_ledger import StepLedger
from optimizer_node.storage import BucketState, BucketStore
from transport.interface import Message
from transport.wire import WIRE_DTYPES, ErrorCode, Header, MsgType, WireError

log = logging.getLogger(__name__)


class JobRegistration:
    """HELLO and INIT, and the checks on who may send what."""

    # State owned by NodeDaemon, used here.
    config: NodeConfig
    node_id: str
    same_host_address: str | None
    _store: BucketStore
    _job: ActiveJob | None
    _ledger: StepLedger
    _in_flight: dict[int, BucketStep]
    _deferred_hellos: list[Message]

    if TYPE_CHECKING:  # provided by NodeDaemon and its other mixins

        @property
        def step(self) -> int: ...
        def handle(self, message: Message) -> None: ...
        def _send(self, peer: bytes, header: Header, payload: torch.Tensor | None = None) -> None: ...
        def _answer_deferred_pulls(self, state: BucketState) -> None: ...
        def _rank_rejoined(self, rank: int) -> None: ...
        def _job_initialized(self) -> None: ...

    def _require_job(self) -> ActiveJob:
        if self._job is None:
            raise WireError(ErrorCode.NOT_REGISTERED, "no job is registered yet: rank 0 must say HELLO first")
        return self._job

    def _require_rank(self, message: Message) -> ActiveJob:
        job = self._require_job()
        rank = message.header.rank
        if not self._ledger.is_current(rank, message.peer):
            raise WireError(ErrorCode.NOT_REGISTERED, self._ledger.describe(rank, message.peer))
        return job

    def _on_hello(self, message: Message) -> None:
        header = message.header
        try:
            spec = JobSpec.from_wire(header.meta.get("job"))
            node_index = header.meta.get("node_index")
            if not isinstance(node_index, int) or not 0 <= node_index < spec.num_nodes:
                raise ValueError(f"node_index {node_index!r} is not in [0, {spec.num_nodes})")
            if not 0 <= header.rank < spec.world_size:
                raise ValueError(f"rank {header.rank} is not in [0, {spec.world_size})")
            incarnation = header.meta.get("incarnation")
            if not isinstance(incarnation, int) or isinstance(incarnation, bool) or not 0 < incarnation < 1 << 64:
                raise ValueError(f"incarnation must be a positive 64-bit integer naming the worker process, got {incarnation!r}")
            plan = spec.plan()  # duplicate names, a bucket size below the split alignment, ...
        except ValueError as exc:
            raise WireError(ErrorCode.BAD_REQUEST, f"bad HELLO: {exc}") from None
        if self._job is None:
            if header.rank != 0:
                log.info("rank %d said HELLO before rank 0; holding it until rank 0 registers", header.rank)
                self._deferred_hellos.append(message)
                notice = {"waiting_for": f"rank 0 has not registered the job on node {self.node_id} yet; rank {header.rank} waits for it"}
                self._send(message.peer, Header(msg_type=MsgType.NOTICE, rank=header.rank, meta=notice))
                return
            problem = self._fit_problem(spec, node_index, plan)
            if problem is not None:
                log.error("cannot take the job: %s", problem)
                raise WireError(ErrorCode.CANNOT_FIT, f"node {self.node_id}: {problem}")
            self._job = ActiveJob.create(spec, node_index, plan)
            owned = self._job.owned
            total = sum(b.numel for b in owned.values())
            log.info(
                "registered job: %d workers, %d nodes (this is node %d), %d parameters, %d buckets here (%.1f M elements), wire %s, clipping %s",
                spec.world_size,
                spec.num_nodes,
                node_index,
                len(spec.params),
                len(owned),
                total / 1e6,
                spec.wire_dtype,
                spec.max_grad_norm,
            )
        job = self._job
        difference = job.spec.mismatch(spec)
        if difference is None and node_index != job.node_index:
            difference = f"this node is node {job.node_index} of the job, the worker addressed it as node {node_index}"
        if difference is not None:
            raise WireError(ErrorCode.LAYOUT_MISMATCH, f"rank {header.rank} does not match the registered job: {difference}")
        how = self._ledger.register(header.rank, message.peer, incarnation)
        resume_step, contributed = self._resume_point(job, header.rank)
        if how == "restarted":
            log.warning(
                "rank %d restarted (a new process, incarnation %x): it redoes step %d, where %d of this node's %d buckets already have its gradient",
                header.rank,
                incarnation,
                resume_step,
                len(contributed),
                len(job.owned),
            )
        elif how == "moved":
            log.info("rank %d reconnected", header.rank)
        needs_init = [b for b in sorted(job.owned) if self._store.get(b) is None]
        reply = Header(
            msg_type=MsgType.HELLO_OK,
            rank=header.rank,
            step=self.step,
            meta={
                "node_id": self.node_id,
                "owned": sorted(job.owned),
                "needs_init": needs_init,
                "resume_step": resume_step,
                "contributed": contributed,
                **({"same_host": self.same_host_address} if self.same_host_address else {}),
            },
        )
        self._send(message.peer, reply)
        if how in ("restarted", "moved"):
            self._rank_rejoined(header.rank)
        if header.rank == 0 and self._deferred_hellos:
            deferred, self._deferred_hellos = self._deferred_hellos, []
            for held in deferred:
                self.handle(held)

    def _resume_point(self, job: ActiveJob, rank: int) -> tuple[int, list[int]]:
        """Where ``rank`` resumes at this node: see :meth:`StepLedger.resume_point`."""
        steps = {b: state.step for b in job.owned if (state := self._store.get(b)) is not None}
        if len(steps) < len(job.owned):  # rank 0 is still registering initial values
            return 0, []

        def has_gradient(bucket_id: int, rank: int) -> bool:
            in_flight = self._in_flight.get(bucket_id)
            return in_flight is not None and rank in in_flight.reduction.received

        return self._ledger.resume_point(rank, steps, has_gradient)

    def _fit_problem(self, spec: JobSpec, node_index: int, plan: list[BucketSpec]) -> str | None:
        params = sum(b.numel for b in plan if b.node == node_index)
        needs = node_needs(params, workers=spec.world_size, wire_bytes=WIRE_DTYPES[spec.wire_dtype].itemsize, layerwise=spec.mode == "layerwise")
        return fit_problem(
            needs,
            state_dir=self.config.state_dir,
            memory_budget=self.config.memory_budget,
            bucket_bytes=STATE_BYTES_PER_PARAM * spec.bucket_numel,
            num_nodes=spec.num_nodes,
        )

    def _owned_bucket(self, job: ActiveJob, header: Header) -> BucketSpec:
        spec = job.owned.get(header.bucket_id)
        if spec is None:
            raise WireError(ErrorCode.UNKNOWN_BUCKET, f"bucket {header.bucket_id} is not owned by node {job.node_index} ({self.node_id})")
        return spec

    def _check_payload(self, header: Header, bucket: BucketSpec, dtype: str) -> None:
        if header.dtype != dtype:
            raise WireError(ErrorCode.WRONG_DTYPE, f"bucket {bucket.bucket_id} travels as {dtype}, got {header.dtype or 'no payload'}")
        if header.numel != bucket.numel:
            raise WireError(ErrorCode.WRONG_SHAPE, f"bucket {bucket.bucket_id} has {bucket.numel} elements, got {header.numel}")

    def _on_init(self, message: Message) -> None:
        job = self._require_rank(message)
        header = message.header
        if header.rank != 0:
            raise WireError(ErrorCode.BAD_REQUEST, "only rank 0 sends initial values")
        bucket = self._owned_bucket(job, header)
        self._check_payload(header, bucket, "float32")
        if self._store.get(bucket.bucket_id) is not None:
            raise WireError(ErrorCode.BAD_REQUEST, f"bucket {bucket.bucket_id} is already initialized")
        initial = torch.empty(bucket.numel, dtype=torch.float32)
        for offset, view in message.tensors:
            initial[offset : offset + view.numel()].copy_(view)
        self._store.create(bucket.bucket_id, initial)
        if len(self._store) == len(job.owned):
            self._job_initialized()
        self._send(message.peer, Header(msg_type=MsgType.ACK, bucket_id=bucket.bucket_id))
        state = self._store.get(bucket.bucket_id)
        assert state is not None
        self._answer_deferred_pulls(state)
