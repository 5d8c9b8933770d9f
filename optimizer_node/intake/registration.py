"""How a node takes a job: HELLO registers it (rank 0 first; other ranks wait for it), checks that
every worker describes the same job and that this node can hold its share; INIT stores rank 0's
initial values; a HELLO at another width morphs the job, one with a param group added extends it.
And who may send what: a registered rank on its own connection (with CURVE, *and* its key).

:class:`JobRegistrar` runs these on the daemon's thread and asks the daemon through the narrow
:class:`RegisteredNode` face; the checks themselves are the job's
:class:`~optimizer_node.intake.admission.JobAdmission`.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from netoptim.job.spec import JobSpec, LimitError
from optimizer_node.config import NodeConfig
from optimizer_node.intake.admission import JobAdmission, job_fingerprint
from optimizer_node.intake.morphing import MorphGate
from optimizer_node.intake.waiting_hellos import WaitingHellos
from optimizer_node.job_state import ActiveJob, JobNode
from optimizer_node.log_limits import RateLimitedLog
from optimizer_node.serving.replies import ParameterReplies
from optimizer_node.state.persistence import Checkpoints
from optimizer_node.state.storage import BucketStore
from transport.interface import Message
from transport.wire import ErrorCode, Header, MsgType, WireError
from transport.zeromq.security import AllowList

log = logging.getLogger(__name__)


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


def _unregistered_text(rank: int) -> str:
    """What a connection that is not ``rank`` is told: the same whatever the reason, so that it learns
    nothing about who is registered (the node logs the reason)."""
    return (
        f"this connection is not registered as rank {rank}: it has not said HELLO, or another process has registered as rank {rank} since "
        "and this one is no longer part of the job"
    )


class RegisteredNode(JobNode, Protocol):
    """What :class:`JobRegistrar` reads and asks of the daemon, besides :class:`JobNode`."""

    config: NodeConfig
    same_host_address: str | None
    limit_log: RateLimitedLog
    admission: JobAdmission

    @property
    def store(self) -> BucketStore: ...
    @property
    def replies(self) -> ParameterReplies: ...
    @property
    def morphs(self) -> MorphGate: ...
    @property
    def checkpoints(self) -> Checkpoints: ...
    def take_job(self, job: ActiveJob) -> None: ...
    def change_width(self, spec: JobSpec, at: int) -> None: ...
    def go_on_after_finish(self) -> None: ...
    def gradient_received(self, bucket_id: int, rank: int) -> bool: ...
    def gradients_in_flight(self) -> bool: ...
    def let_job_go(self, reason: str) -> dict: ...
    def handle(self, message: Message) -> None: ...
    def reply(self, peer: bytes, header: Header) -> None: ...
    def rank_rejoined(self, rank: int) -> None: ...


class JobRegistrar:
    """HELLO and INIT, and who may send what. Node-wide: it holds the HELLOs of ranks that came before
    their rank 0 (of this job or the next) and, with CURVE, which ranks each allowed key may register as."""

    def __init__(self, node: RegisteredNode, waiting: WaitingHellos, allow_list: AllowList | None) -> None:
        self._node = node
        self._waiting = waiting
        self._allow_list = allow_list

    def require_job(self) -> ActiveJob:
        """The registered job; NOT_REGISTERED (saying how a job registers) without one."""
        job = self._node.active_job
        if job is None:
            if self._node.jobs_let_go:  # a rank of a job the node let go (reset, or finished and replaced)
                raise WireError(ErrorCode.NOT_REGISTERED, "no job is registered: this node let its previous job go; rank 0 must say HELLO first")
            raise WireError(ErrorCode.NOT_REGISTERED, "no job is registered yet: rank 0 must say HELLO first")
        return job

    def is_registered(self, message: Message) -> bool:
        """Whether the message comes from the current connection (and key) of the rank it names."""
        return self._node.ledger.is_current(message.header.rank, message.peer, message.user_id)

    def require_rank(self, message: Message) -> ActiveJob:
        """The job, where the message comes from the registered connection of its rank; NOT_REGISTERED
        (the same words whatever the reason) otherwise."""
        job = self.require_job()
        rank = message.header.rank
        if not self.is_registered(message):
            ledger = self._node.ledger
            record = ledger.ranks.get(rank)
            if record is not None and record.peer == message.peer:  # another key on the rank's routing id
                self._node.limit_log.log("rank-taken-over", logging.WARNING, "key %s: %s", (message.user_id or "none")[:8], ledger.describe(rank, message.peer))
            else:
                log.debug("not rank %d: %s", rank, ledger.describe(rank, message.peer))
            raise WireError(ErrorCode.NOT_REGISTERED, _unregistered_text(rank))
        return job

    def _is_another_job(self, spec: JobSpec, node_index: int) -> bool:
        """Whether a HELLO describes a job other than the registered one (a param group added to it is the same job)."""
        job = self._node.active_job
        return job is not None and (node_index != job.node_index or (spec != job.spec and not job.spec.extended_by(spec)))

    def on_hello(self, message: Message) -> None:
        node, header = self._node, message.header
        if self._allow_list is not None:  # CURVE: the key must be allowed this rank, before anything is parsed or held
            refusal = self._allow_list.refusal(message.user_id, header.rank)
            if refusal is not None:
                raise WireError(ErrorCode.FORBIDDEN, refusal)
        spec, node_index, incarnation = node.admission.parse_hello(message)
        if node.finished_step is not None and node.config.next_job == "take" and self._is_another_job(spec, node_index):
            if header.rank != 0:  # the next job's rank 0 lets the finished one go
                self._hold_hello(message)
                return
            node.let_job_go(f"it was finished and rank 0 of job {job_fingerprint(spec)} said HELLO")
        at = node.morphs.requested_step(message)
        current = node.active_job
        if at is not None and current is not None and node_index == current.node_index and MorphGate.morphs_to(current.spec, spec):
            if self._hold_or_morph(message, spec, at):
                return
        current = node.active_job
        if current is None:
            if header.rank != 0:
                self._hold_hello(message)
                return
            self._register(spec, node_index)
        elif spec != current.spec and node_index == current.node_index and current.spec.extended_by(spec):
            if header.rank != 0:  # a param group added mid-run: rank 0 extends the job first
                self._hold_hello(message)
                return
            self._extend_job(spec, node_index)
        job = node.active_job
        assert job is not None
        node.admission.check_same_job(job, spec, node_index, header.rank, finished=node.finished_step is not None)
        how = node.ledger.register(header.rank, message.peer, incarnation, message.user_id)
        if node.finished_step is not None:
            log.warning("rank %d of the finished job said HELLO again: the job goes on from step %d", header.rank, node.step)
            node.go_on_after_finish()
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
        batches = node.replies.note_batching(header.rank, message.peer, header.meta.get("batches") is True)
        needs_init = [b for b in sorted(job.owned) if node.store.get(b) is None]
        reply = Header(
            msg_type=MsgType.HELLO_OK,
            rank=header.rank,
            step=node.step,
            meta={
                "node_id": node.node_id,
                "owned": sorted(job.owned),
                "needs_init": needs_init,
                "resume_step": resume_step,
                "contributed": contributed,
                "non_finite": node.config.non_finite,  # workers check that every node of the job has the same policy
                "batches": batches,  # small buckets travel several to a message, both ways (transport.batches)
                **({"same_host": node.same_host_address} if node.same_host_address else {}),
            },
        )
        node.reply(message.peer, reply)
        if how in ("restarted", "moved"):
            node.rank_rejoined(header.rank)
        if header.rank == 0 and self._waiting:
            for held in self._waiting.take_all():
                node.handle(held)

    def _register(self, spec: JobSpec, node_index: int) -> None:
        """Rank 0's HELLO of a new job: planned, checked against this node's memory, taken."""
        node = self._node
        plan = node.admission.plan_job(spec)
        problem = node.admission.fit_problem(spec, node_index, plan)
        if problem is not None:
            log.error("cannot take the job: %s", problem)
            raise WireError(ErrorCode.CANNOT_FIT, f"node {node.node_id}: {problem}")
        job = ActiveJob.create(spec, node_index, plan)
        node.take_job(job)
        owned = job.owned
        log.info(
            "registered job: %d workers, %d nodes (this is node %d), %d parameters, %d buckets here (%.1f M elements), wire %s, clipping %s",
            spec.world_size,
            spec.num_nodes,
            node_index,
            len(spec.params),
            len(owned),
            sum(b.numel for b in owned.values()) / 1e6,
            spec.wire_dtype,
            spec.max_grad_norm,
        )

    def _hold_or_morph(self, message: Message, spec: JobSpec, at: int) -> bool:
        """A HELLO of the registered job at another width, to take effect at step ``at``
        (:mod:`optimizer_node.intake.morphing`): held (True) until every owned bucket reached ``at``, then the
        job morphs and the HELLO registers as usual (False)."""
        node = self._node
        job = node.active_job
        assert job is not None
        if job.spec.mode != "full":
            raise WireError(ErrorCode.BAD_REQUEST, "a layer-wise job cannot change its width: morphing is for full-model jobs")
        store = node.store
        steps = {state.step for state in store}
        if len(store) < len(job.owned) or max(steps, default=0) > at:
            raise WireError(
                ErrorCode.BAD_REQUEST,
                f"node {node.node_id} is at step {node.step}{' (initial values missing)' if len(store) < len(job.owned) else ''}, past or "
                f"not ready for the morph at step {at}: restart the workers at the new width (they resume at the nodes' step)",
            )
        if min(steps, default=0) < at:
            node.morphs.hold(at, message)
            notice = {"waiting_for": f"node {node.node_id} is at step {node.step}; the job changes its width at step {at}"}
            node.reply(message.peer, Header(msg_type=MsgType.NOTICE, rank=message.header.rank, meta=notice))
            return True
        node.change_width(spec, at)
        return False

    def _extend_job(self, spec: JobSpec, node_index: int) -> None:
        """Rank 0 added a param group between steps (``add_param_group``): the job takes its
        parameters in buckets after the existing ones, which keep their places and state; the new
        buckets start at the job's current step with zero moments, once rank 0 sends their values."""
        node = self._node
        job = node.active_job
        assert job is not None
        if node.gradients_in_flight():
            raise WireError(ErrorCode.BAD_REQUEST, "a param group can only be added between steps: this node holds gradients of the step in progress")
        plan = node.admission.plan_job(spec)
        problem = node.admission.fit_problem(spec, node_index, plan)
        if problem is not None:
            raise WireError(ErrorCode.CANNOT_FIT, f"node {node.node_id} cannot take the added param group: {problem}")
        base = node.step
        added = len(spec.params) - len(job.spec.params)
        extended = ActiveJob.create(spec, node_index, plan, base_step=base)
        node.take_job(extended)
        log.info("rank 0 added %d parameter(s) in a new param group at step %d: this node now owns %d buckets", added, base, len(extended.owned))

    def _hold_hello(self, message: Message) -> None:
        """Hold the HELLO of a rank other than 0 until rank 0 registers the job (within
        ``--max-waiting-hellos`` and ``--max-waiting-hello-bytes``: LIMIT beyond them)."""
        node, rank = self._node, message.header.rank
        try:
            self._waiting.hold(message)
        except LimitError as exc:
            raise WireError(ErrorCode.LIMIT, f"node {node.node_id}: {exc}") from None
        node.limit_log.log("waiting-hello", logging.INFO, "rank %d said HELLO before rank 0; holding it until rank 0 registers", rank)
        notice = {"waiting_for": f"rank 0 has not registered the job on node {node.node_id} yet; rank {rank} waits for it"}
        node.reply(message.peer, Header(msg_type=MsgType.NOTICE, rank=rank, meta=notice))

    def _resume_point(self, job: ActiveJob, rank: int) -> tuple[int, list[int]]:
        """Where ``rank`` resumes at this node: see :meth:`StepLedger.resume_point`."""
        steps = {b: state.step for b in job.owned if (state := self._node.store.get(b)) is not None}
        if not steps:  # rank 0 has not registered initial values yet (of a new job, or of an added param group)
            return job.base_step, []
        return self._node.ledger.resume_point(rank, steps, self._node.gradient_received)

    def on_init(self, message: Message) -> None:
        """Rank 0's initial values of one bucket."""
        node = self._node
        job = self.require_rank(message)
        header = message.header
        if header.rank != 0:
            raise WireError(ErrorCode.BAD_REQUEST, "only rank 0 sends initial values")
        bucket = node.admission.owned_bucket(job, header)
        node.admission.check_payload(header, bucket, "float32")
        store = node.store
        if store.get(bucket.bucket_id) is not None:
            raise WireError(ErrorCode.BAD_REQUEST, f"bucket {bucket.bucket_id} is already initialized")
        initial = torch.empty(bucket.numel, dtype=torch.float32)
        for offset, view in message.tensors:
            initial[offset : offset + view.numel()].copy_(view)
        store.create(bucket.bucket_id, initial).step = job.base_step  # an added param group's buckets join at the current step
        if len(store) == len(job.owned):
            node.checkpoints.job_initialized()
        node.reply(message.peer, Header(msg_type=MsgType.ACK, bucket_id=bucket.bucket_id))
        state = store.get(bucket.bucket_id)
        assert state is not None
        node.replies.answer_deferred(state, job)
