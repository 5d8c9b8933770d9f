"""How a node takes a job: HELLO registers it (rank 0 first; other ranks wait for it), checks that
every worker describes the same job and that this node can hold its share; INIT stores rank 0's
initial values. The checks every later message goes through (a registered rank on its own
connection, a bucket this node owns, the payload's dtype and size) live here too. A mixin of
:class:`~optimizer_node.daemon.NodeDaemon`; runs on the daemon thread only.

Who may say what: with CURVE, a HELLO's key must be allowed the rank it asks for (FORBIDDEN
otherwise), and a registered rank is its connection *and* that key. A peer that is not a registered
rank learns nothing about the job from its errors: a HELLO that does not match says which field
differs and the worker's own value, with a fingerprint of the registered job; the node's log has the
rest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from typing import TYPE_CHECKING

import torch

from job.placement import BucketSpec
from job.spec import JobSpec, LimitError
from optimizer_node.clipping import GlobalNormRound
from optimizer_node.config import NodeConfig
from optimizer_node.job_state import ActiveJob, BucketStep
from optimizer_node.log_limits import RateLimitedLog
from optimizer_node.memory_plan import STATE_BYTES_PER_PARAM, fit_problem, node_needs
from optimizer_node.morphing import MorphGate
from optimizer_node.persistence import Checkpoints
from optimizer_node.replies import ParameterReplies
from optimizer_node.step_ledger import StepLedger
from optimizer_node.storage import BucketStore
from optimizer_node.waiting_hellos import WaitingHellos
from transport.batches import MAX_BATCH_BYTES
from transport.interface import Message, ServerEndpoint
from transport.security import AllowList
from transport.shm_window import UNIT_BYTES
from transport.wire import WIRE_DTYPES, ErrorCode, Header, MsgType, WireError

log = logging.getLogger(__name__)

STATE_BYTES_PER_FP32 = 4
"""Bytes of an fp32 element: the widest a payload travels in (INIT is fp32)."""


def load_allow_list(directory: str) -> AllowList:
    """The node's ``--curve-allow`` directory, read once at start; warns about keys bound to no rank."""
    allow_list = AllowList.load(directory)
    unbound = allow_list.unbound
    if unbound:
        log.warning(
            "%d of the %d allowed CURVE key(s) are bound to no rank: any holder may register as any rank; re-create with netoptim keygen --ranks: %s",
            len(unbound),
            len(allow_list),
            ", ".join(str(grant) for grant in unbound),
        )
    return allow_list


def job_fingerprint(spec: JobSpec) -> str:
    """A short hash of a job's description: what a worker whose HELLO does not match is told about the
    registered job (and what the node logs beside it), enough to tell two jobs apart and no more."""
    canonical = json.dumps(spec.to_wire(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def _shown(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def public_mismatch(registered: JobSpec, theirs: JobSpec) -> str:
    """The first field where ``theirs`` differs from ``registered``, said with the worker's own value
    only: the registered value stays in the node's log (see :meth:`JobSpec.mismatch`)."""
    names = [spec_field.name for spec_field in dataclasses.fields(JobSpec)]
    for name in sorted(names, key=lambda name: name != "mode"):  # the mode first, as JobSpec.mismatch: it explains the rest
        mine, other = getattr(registered, name), getattr(theirs, name)
        if mine == other:
            continue
        if name != "params":
            return f"{name} differs (this worker has {_shown(other)})"
        for index, (want, have) in enumerate(zip(mine, other, strict=False)):
            if want != have:
                return f"parameter {index} differs (this worker has {have.name!r} shape {list(have.shape)} {have.dtype} group {have.group})"
        return f"the number of parameters differs (this worker has {len(other)})"
    return "the job differs"


def _unregistered_text(rank: int) -> str:
    """What a connection that is not ``rank`` is told: the same whatever the reason, so that it learns
    nothing about who is registered (the node logs the reason)."""
    return (
        f"this connection is not registered as rank {rank}: it has not said HELLO, or another process has registered as rank {rank} since "
        "and this one is no longer part of the job"
    )


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
    _deferred_hellos: WaitingHellos
    _endpoint: ServerEndpoint
    _payload_limit: int  # bytes: max_message_bytes, then the largest owned bucket as fp32
    _payload_why: str  # what the limit is, for the TOO_LARGE reply
    limit_log: RateLimitedLog  # rate-limited lines for what peers can repeat at will
    _allow_list: AllowList | None  # with CURVE: the allowed keys and the ranks each may register as

    if TYPE_CHECKING:  # provided by NodeDaemon

        @property
        def step(self) -> int: ...
        def handle(self, message: Message) -> None: ...
        def _send(self, peer: bytes, header: Header, payload: torch.Tensor | None = None) -> None: ...
        def _rank_rejoined(self, rank: int) -> None: ...
        def let_job_go(self, reason: str) -> dict: ...
        def _flush_outbox(self, peer: bytes | None = None) -> None: ...

    _finished_step: int | None
    jobs_let_go: int
    _morphs: MorphGate
    _ready: list[int]
    _norm_round: GlobalNormRound
    _replies: ParameterReplies
    _checkpoints: Checkpoints
    _buckets_done: dict[int, int]

    def _require_job(self) -> ActiveJob:
        if self._job is None:
            if self.jobs_let_go:  # a rank of a job the node let go (reset, or finished and replaced)
                raise WireError(ErrorCode.NOT_REGISTERED, "no job is registered: this node let its previous job go; rank 0 must say HELLO first")
            raise WireError(ErrorCode.NOT_REGISTERED, "no job is registered yet: rank 0 must say HELLO first")
        return self._job

    def _is_another_job(self, spec: JobSpec, node_index: int) -> bool:
        """Whether a HELLO describes a job other than the registered one (a param group added to it is the same job)."""
        job = self._job
        return job is not None and (node_index != job.node_index or (spec != job.spec and not job.spec.extended_by(spec)))

    def _is_registered(self, message: Message) -> bool:
        """Whether the message comes from the current connection (and key) of the rank it names."""
        return self._ledger.is_current(message.header.rank, message.peer, message.user_id)

    def _require_rank(self, message: Message) -> ActiveJob:
        job = self._require_job()
        rank = message.header.rank
        if not self._is_registered(message):
            record = self._ledger.ranks.get(rank)
            if record is not None and record.peer == message.peer:  # another key on the rank's routing id
                self.limit_log.log("rank-taken-over", logging.WARNING, "key %s: %s", (message.user_id or "none")[:8], self._ledger.describe(rank, message.peer))
            else:
                log.debug("not rank %d: %s", rank, self._ledger.describe(rank, message.peer))
            raise WireError(ErrorCode.NOT_REGISTERED, _unregistered_text(rank))
        return job

    def _on_hello(self, message: Message) -> None:
        header = message.header
        if self._allow_list is not None:  # CURVE: the key must be allowed this rank, before anything is parsed or held
            refusal = self._allow_list.refusal(message.user_id, header.rank)
            if refusal is not None:
                raise WireError(ErrorCode.FORBIDDEN, refusal)
        spec, node_index, incarnation = self._parse_hello(message)
        if self._finished_step is not None and self.config.next_job == "take" and self._is_another_job(spec, node_index):
            if header.rank != 0:  # the next job's rank 0 lets the finished one go
                self._hold_hello(message)
                return
            self.let_job_go(f"it was finished and rank 0 of job {job_fingerprint(spec)} said HELLO")
        at = self._morphs.requested_step(message)
        if at is not None and self._job is not None and node_index == self._job.node_index and MorphGate.morphs_to(self._job.spec, spec):
            if self._hold_or_morph(message, spec, at):
                return
        if self._job is None:
            if header.rank != 0:
                self._hold_hello(message)
                return
            plan = self._plan_job(spec)
            problem = self._fit_problem(spec, node_index, plan)
            if problem is not None:
                log.error("cannot take the job: %s", problem)
                raise WireError(ErrorCode.CANNOT_FIT, f"node {self.node_id}: {problem}")
            self._job = ActiveJob.create(spec, node_index, plan)
            self._limit_payloads(self._job)
            self._replies.publish_board(self._job)
            self._size_gradient_windows(self._job)
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
        elif spec != self._job.spec and node_index == self._job.node_index and self._job.spec.extended_by(spec):
            if header.rank != 0:  # a param group added mid-run: rank 0 extends the job first
                self._hold_hello(message)
                return
            self._extend_job(spec, node_index)
        job = self._job
        self._check_same_job(job, spec, node_index, header.rank)
        how = self._ledger.register(header.rank, message.peer, incarnation, message.user_id)
        if self._finished_step is not None:
            log.warning("rank %d of the finished job said HELLO again: the job goes on from step %d", header.rank, self.step)
            self._finished_step = None
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
        batches = self._replies.note_batching(header.rank, message.peer, header.meta.get("batches") is True)
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
                "non_finite": self.config.non_finite,  # workers check that every node of the job has the same policy
                "batches": batches,  # small buckets travel several to a message, both ways (transport.batches)
                **({"same_host": self.same_host_address} if self.same_host_address else {}),
            },
        )
        self._send(message.peer, reply)
        if how in ("restarted", "moved"):
            self._rank_rejoined(header.rank)
        if header.rank == 0 and self._deferred_hellos:
            for held in self._deferred_hellos.take_all():
                self.handle(held)

    def _hold_or_morph(self, message: Message, spec: JobSpec, at: int) -> bool:
        """A HELLO of the registered job at another width, to take effect at step ``at``
        (:mod:`optimizer_node.morphing`): held (True) until every owned bucket reached ``at``, then the
        job morphs and the HELLO registers as usual (False)."""
        job = self._job
        assert job is not None
        if job.spec.mode != "full":
            raise WireError(ErrorCode.BAD_REQUEST, "a layer-wise job cannot change its width: morphing is for full-model jobs")
        steps = {state.step for state in self._store}
        if len(self._store) < len(job.owned) or max(steps, default=0) > at:
            raise WireError(
                ErrorCode.BAD_REQUEST,
                f"node {self.node_id} is at step {self.step}{' (initial values missing)' if len(self._store) < len(job.owned) else ''}, past or "
                f"not ready for the morph at step {at}: restart the workers at the new width (they resume at the nodes' step)",
            )
        if min(steps, default=0) < at:
            self._morphs.hold(at, message)
            notice = {"waiting_for": f"node {self.node_id} is at step {self.step}; the job changes its width at step {at}"}
            self._send(message.peer, Header(msg_type=MsgType.NOTICE, rank=message.header.rank, meta=notice))
            return True
        self._flush_outbox()
        dropped = sum(len(in_flight.reduction.received) for in_flight in self._in_flight.values())
        self._in_flight.clear()  # gradients of step `at` from the old width: none is applied, none mixed in
        self._ready.clear()
        self._replies.forget_ranks()
        self._norm_round.reset()
        self._buckets_done.clear()
        self._ledger = StepLedger()  # the old width's ranks are not part of the job any more
        self._job = ActiveJob.create(spec, job.node_index, base_step=job.base_step)  # the same buckets: the plan does not depend on the width
        self._morphs.morphed(at, job.spec.world_size, spec.world_size, dropped)
        return False

    def _extend_job(self, spec: JobSpec, node_index: int) -> None:
        """Rank 0 added a param group between steps (``add_param_group``): the job takes its
        parameters in buckets after the existing ones, which keep their places and state; the new
        buckets start at the job's current step with zero moments, once rank 0 sends their values."""
        assert self._job is not None
        if self._in_flight:
            raise WireError(ErrorCode.BAD_REQUEST, "a param group can only be added between steps: this node holds gradients of the step in progress")
        plan = self._plan_job(spec)
        problem = self._fit_problem(spec, node_index, plan)
        if problem is not None:
            raise WireError(ErrorCode.CANNOT_FIT, f"node {self.node_id} cannot take the added param group: {problem}")
        base = self.step
        added = len(spec.params) - len(self._job.spec.params)
        self._job = ActiveJob.create(spec, node_index, plan, base_step=base)
        self._limit_payloads(self._job)
        self._replies.publish_board(self._job)
        self._size_gradient_windows(self._job)
        log.info("rank 0 added %d parameter(s) in a new param group at step %d: this node now owns %d buckets", added, base, len(self._job.owned))

    def _parse_hello(self, message: Message) -> tuple[JobSpec, int, int]:
        """The job, node index and incarnation a HELLO declares. Checked against this node's limits
        (LIMIT, naming the flag that raises the one exceeded) before anything proportional to the
        sizes it declares is made or iterated; BAD_REQUEST for what no job can have."""
        header = message.header
        if header.numel or header.num_chunks or message.tensors:
            raise WireError(ErrorCode.BAD_REQUEST, "bad HELLO: a HELLO carries no tensor payload")
        limits = self.config.job_limits()
        try:
            spec = JobSpec.from_wire(header.meta.get("job"), limits)
            spec.check_limits(limits)  # duplicate names, a bucket size below the split alignment, sizes over the limits
            node_index = header.meta.get("node_index")
            if not isinstance(node_index, int) or not 0 <= node_index < spec.num_nodes:
                raise ValueError(f"node_index {node_index!r} is not in [0, {spec.num_nodes})")
            if not 0 <= header.rank < spec.world_size:
                raise ValueError(f"rank {header.rank} is not in [0, {spec.world_size})")
            incarnation = header.meta.get("incarnation")
            if not isinstance(incarnation, int) or isinstance(incarnation, bool) or not 0 < incarnation < 1 << 64:
                raise ValueError(f"incarnation must be a positive 64-bit integer naming the worker process, got {incarnation!r}")
        except LimitError as exc:
            raise WireError(ErrorCode.LIMIT, f"node {self.node_id} refuses the job: {exc}") from None
        except ValueError as exc:
            raise WireError(ErrorCode.BAD_REQUEST, f"bad HELLO: {exc}") from None
        return spec, node_index, incarnation

    def _plan_job(self, spec: JobSpec) -> list[BucketSpec]:
        """The bucket plan of a job rank 0 registers (its size bounded by :meth:`_parse_hello`'s
        checks): LIMIT for more buckets than this node takes, or a bucket larger than a message may
        be (rank 0 could not send its initial values); BAD_REQUEST for a plan no job can have."""
        try:
            plan = spec.plan_within(self.config.job_limits())
        except LimitError as exc:
            raise WireError(ErrorCode.LIMIT, f"node {self.node_id} refuses the job: {exc}") from None
        except ValueError as exc:
            raise WireError(ErrorCode.BAD_REQUEST, f"bad HELLO: {exc}") from None
        largest = STATE_BYTES_PER_FP32 * max((bucket.numel for bucket in plan), default=0)
        if largest > self.config.max_message_bytes:
            error = LimitError(
                f"the job's largest bucket is {largest} bytes as fp32 (rank 0's initial values), over this node's limit of "
                f"{self.config.max_message_bytes} bytes per message",
                "--max-message-bytes",
            )
            raise WireError(ErrorCode.LIMIT, f"node {self.node_id} refuses the job: {error}")
        return plan

    def _hold_hello(self, message: Message) -> None:
        """Hold the HELLO of a rank other than 0 until rank 0 registers the job (within
        ``--max-waiting-hellos`` and ``--max-waiting-hello-bytes``: LIMIT beyond them)."""
        rank = message.header.rank
        try:
            self._deferred_hellos.hold(message)
        except LimitError as exc:
            raise WireError(ErrorCode.LIMIT, f"node {self.node_id}: {exc}") from None
        self.limit_log.log("waiting-hello", logging.INFO, "rank %d said HELLO before rank 0; holding it until rank 0 registers", rank)
        notice = {"waiting_for": f"rank 0 has not registered the job on node {self.node_id} yet; rank {rank} waits for it"}
        self._send(message.peer, Header(msg_type=MsgType.NOTICE, rank=rank, meta=notice))

    def _limit_payloads(self, job: ActiveJob) -> None:
        """From now on no message may carry more than this node's largest bucket as fp32: refused with
        TOO_LARGE before its payload is viewed (by the endpoint, or by :meth:`_check_payload_size`)."""
        bucket_bytes = STATE_BYTES_PER_FP32 * max((bucket.numel for bucket in job.owned.values()), default=0)
        largest = max(bucket_bytes, MAX_BATCH_BYTES)  # small buckets travel in batches (transport.batches)
        why = f"this node's limit since the job was registered: its largest bucket here as fp32 or a batch of small ones, {largest} bytes"
        if largest < self._payload_limit:
            self._payload_limit, self._payload_why = largest, why
        self._endpoint.limit_payload(largest, why)

    def _size_gradient_windows(self, job: ActiveJob) -> None:
        """Same-host workers that connect from now on get a window for their gradients that holds a whole
        step of what each pushes here (this node's buckets in the wire dtype), where the node keeps its
        state in memory (the memory plan counts those gradients already): a worker then gathers each
        bucket straight into it, on a GPU with one device-to-host copy, and the node reads it there.
        Otherwise, and with --no-same-host-gradient-window, the window keeps --same-host-window-mb."""
        if not self.config.same_host_gradient_window or self.config.state_dir is not None:
            return
        wire_bytes = WIRE_DTYPES[job.spec.wire_dtype].itemsize
        step_bytes = sum(-(-bucket.numel * wire_bytes // UNIT_BYTES) * UNIT_BYTES for bucket in job.owned.values())
        self._endpoint.size_inboxes(step_bytes)

    def _check_payload_size(self, header: Header) -> None:
        """TOO_LARGE for a payload over the node's limit, for backends whose endpoint does not check it."""
        if header.payload_bytes > self._payload_limit:
            raise WireError(ErrorCode.TOO_LARGE, f"payload of {header.payload_bytes} bytes is over {self._payload_why}")

    def _check_same_job(self, job: ActiveJob, spec: JobSpec, node_index: int, rank: int) -> None:
        """LAYOUT_MISMATCH unless the HELLO describes the registered job and this node's place in it.
        The worker is told the field and its own value; the registered layout goes to the log only."""
        difference = job.spec.mismatch(spec)
        if difference is None and node_index == job.node_index:
            return
        registered = job_fingerprint(job.spec)
        if difference is None:
            self.limit_log.log(
                "layout-mismatch", logging.WARNING, "rank %d addressed this node (node %d of job %s) as node %d", rank, job.node_index, registered, node_index
            )
            told = f"the worker addressed this node as node {node_index}, which is not its place in the registered job: give every worker the node addresses in the same order"
        else:
            self.limit_log.log("layout-mismatch", logging.WARNING, "rank %d's HELLO does not match the registered job %s: %s", rank, registered, difference)
            told = public_mismatch(job.spec, spec)
        if self._finished_step is not None:
            told += "; the registered job is finished, and this node takes another only after `netoptim admin reset` (it runs with --next-job refuse)"
        raise WireError(
            ErrorCode.LAYOUT_MISMATCH,
            f"rank {rank} does not match the job registered here (fingerprint {registered}; this worker's job: {job_fingerprint(spec)}): {told}",
        )

    def _resume_point(self, job: ActiveJob, rank: int) -> tuple[int, list[int]]:
        """Where ``rank`` resumes at this node: see :meth:`StepLedger.resume_point`."""
        steps = {b: state.step for b in job.owned if (state := self._store.get(b)) is not None}
        if not steps:  # rank 0 has not registered initial values yet (of a new job, or of an added param group)
            return job.base_step, []

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
        self._store.create(bucket.bucket_id, initial).step = job.base_step  # an added param group's buckets join at the current step
        if len(self._store) == len(job.owned):
            self._checkpoints.job_initialized()
        self._send(message.peer, Header(msg_type=MsgType.ACK, bucket_id=bucket.bucket_id))
        state = self._store.get(bucket.bucket_id)
        assert state is not None
        self._replies.answer_deferred(state, job)
