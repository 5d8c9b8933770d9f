"""How a node takes a job: HELLO registers it (rank 0 first; other ranks wait for it), checks that
every worker describes the same job and that this node can hold its share; INIT stores rank 0's
initial values; a HELLO at another width morphs the job, one with a param group added extends it.
And who may send what: a registered rank on its own connection (with CURVE, *and* its key).

:class:`JobRegistrar` (node-wide) checks a HELLO's key, holds the HELLOs that came before their rank 0
and lets a finished job go for the next; :class:`JobRegistration` (one a job) registers, morphs and
extends the job and answers HELLO and INIT; :class:`~optimizer_node.intake.rank_check.RankCheck` (one a job) says who may send what.
The checks themselves are the job's :class:`~optimizer_node.intake.admission.JobAdmission`. All run on
the node's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch

from optimizer_node.config import NodeConfig
from optimizer_node.intake.admission import JobAdmission, job_fingerprint
from optimizer_node.intake.morphing import MorphGate
from optimizer_node.intake.rank_check import RankCheck
from optimizer_node.intake.waiting_hellos import WaitingHellos
from optimizer_node.job_state import ActiveJob, CurrentJob
from optimizer_node.log_limits import RateLimitedLog
from optimizer_node.moments.codec import describe_moments
from optimizer_node.serving.replies import ParameterReplies
from optimizer_node.state.persistence import Checkpoints
from protos.job.spec import JobSpec, LimitError
from transport.interface import Message
from transport.wire import ErrorCode, Header, MsgType, WireError
from transport.zeromq.security import AllowList

if TYPE_CHECKING:
    from optimizer_node.job_end import JobEnd

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


Send = Callable[[bytes, Header], None]
HelloOutcome = Literal["answered", "held", "waits_for_rank_0"]


class JobRegistrar:
    """HELLO, node-wide: the key a HELLO comes with (CURVE: which ranks each allowed key may register
    as), the HELLOs of ranks that came before their rank 0 (of this job or the next), and the finished
    job let go for the next one's rank 0 (``--next-job take``). The rest is the job's
    (:class:`JobRegistration`), of the moment: ``registration`` returns it (letting a job go makes a new
    one). ``let_job_go``: lets the job go; ``handle``: the node's handling of a message (the HELLOs held,
    once rank 0 registered); ``send``: how a message goes out."""

    def __init__(
        self,
        waiting: WaitingHellos,
        allow_list: AllowList | None,
        *,
        node_id: str,
        take_next_job: bool,
        limit_log: RateLimitedLog,
        registration: Callable[[], JobRegistration],
        let_job_go: Callable[[str], object],
        handle: Callable[[Message], None],
        send: Send,
    ) -> None:
        self._waiting = waiting
        self._allow_list = allow_list
        self._node_id = node_id
        self._take_next_job = take_next_job
        self._limit_log = limit_log
        self._registration = registration
        self._let_job_go = let_job_go
        self._handle = handle
        self._send = send

    def on_hello(self, message: Message) -> None:
        header = message.header
        if self._allow_list is not None:  # CURVE: the key must be allowed this rank, before anything is parsed or held
            refusal = self._allow_list.refusal(message.user_id, header.rank)
            if refusal is not None:
                raise WireError(ErrorCode.FORBIDDEN, refusal)
        registration = self._registration()
        spec, node_index, incarnation = registration.parse_hello(message)
        if self._take_next_job and registration.finished and registration.is_another_job(spec, node_index):
            if header.rank != 0:  # the next job's rank 0 lets the finished one go
                self._hold_hello(message)
                return
            self._let_job_go(f"it was finished and rank 0 of job {job_fingerprint(spec)} said HELLO")
            registration = self._registration()
        outcome = registration.on_hello(message, spec, node_index, incarnation)
        if outcome == "waits_for_rank_0":
            self._hold_hello(message)
        elif outcome == "answered" and header.rank == 0 and self._waiting:
            for held in self._waiting.take_all():
                self._handle(held)

    def _hold_hello(self, message: Message) -> None:
        """Hold the HELLO of a rank other than 0 until rank 0 registers the job (within
        ``--max-waiting-hellos`` and ``--max-waiting-hello-bytes``: LIMIT beyond them)."""
        rank = message.header.rank
        try:
            self._waiting.hold(message)
        except LimitError as exc:
            raise WireError(ErrorCode.LIMIT, f"node {self._node_id}: {exc}") from None
        self._limit_log.log("waiting-hello", logging.INFO, "rank %d said HELLO before rank 0; holding it until rank 0 registers", rank)
        notice = {"waiting_for": f"rank 0 has not registered the job on node {self._node_id} yet; rank {rank} waits for it"}
        self._send(message.peer, Header(msg_type=MsgType.NOTICE, rank=rank, meta=notice))


class JobRegistration:
    """One job's HELLO and INIT: the job registered, morphed to another width, extended by a param
    group; each rank registered and told where it resumes; rank 0's initial values stored.

    ``current``: where the job stands (its job and ledger change here, through ``take_job`` and
    ``change_width``); ``take_job``: makes a job the registered one; ``change_width``: morphs the job;
    ``rank_rejoined``: what a rank on a new connection is sent again; ``send``: how a message goes out."""

    def __init__(
        self,
        config: NodeConfig,
        node_id: str,
        current: CurrentJob,
        *,
        ranks: RankCheck,
        admission: JobAdmission,
        replies: ParameterReplies,
        morphs: MorphGate,
        checkpoints: Checkpoints,
        job_end: JobEnd,
        same_host_address: str | None,
        take_job: Callable[[ActiveJob], None],
        change_width: Callable[[JobSpec, int], None],
        rank_rejoined: Callable[[int], None],
        send: Send,
    ) -> None:
        self._config = config
        self._node_id = node_id
        self._current = current
        self._ranks = ranks
        self._admission = admission
        self._replies = replies
        self._morphs = morphs
        self._checkpoints = checkpoints
        self._job_end = job_end
        self._same_host_address = same_host_address
        self._take_job = take_job
        self._change_width = change_width
        self._rank_rejoined = rank_rejoined
        self._send = send

    def parse_hello(self, message: Message) -> tuple[JobSpec, int, int]:
        """The job, node index and incarnation a HELLO declares (:meth:`JobAdmission.parse_hello`)."""
        return self._admission.parse_hello(message)

    @property
    def finished(self) -> bool:
        """Whether every rank of the job said BYE (:class:`~optimizer_node.job_end.JobEnd`)."""
        return self._job_end.finished_step is not None

    def is_another_job(self, spec: JobSpec, node_index: int) -> bool:
        """Whether a HELLO describes a job other than the registered one (a param group added to it is the same job)."""
        job = self._current.job
        return job is not None and (node_index != job.node_index or (spec != job.spec and not job.spec.extended_by(spec)))

    def on_hello(self, message: Message, spec: JobSpec, node_index: int, incarnation: int) -> HelloOutcome:
        """A parsed HELLO: ``answered`` (registered, HELLO_OK sent), ``held`` (a morph HELLO, until the
        job reaches the morph's step) or ``waits_for_rank_0`` (for the node-wide registrar to hold)."""
        current, header = self._current, message.header
        at = self._morphs.requested_step(message)
        job = current.job
        if at is not None and job is not None and node_index == job.node_index and MorphGate.morphs_to(job.spec, spec):
            if self._hold_or_morph(message, spec, at):
                return "held"
        job = current.job
        if job is None:
            if header.rank != 0:
                return "waits_for_rank_0"
            self._register(spec, node_index)
        elif spec != job.spec and node_index == job.node_index and job.spec.extended_by(spec):
            if header.rank != 0:  # a param group added mid-run: rank 0 extends the job first
                return "waits_for_rank_0"
            self._extend_job(spec, node_index)
        job = current.job
        assert job is not None
        self._admission.check_same_job(job, spec, node_index, header.rank, finished=self.finished)
        how = current.ledger.register(header.rank, message.peer, incarnation, message.user_id)
        if self.finished:
            log.warning("rank %d of the finished job said HELLO again: the job goes on from step %d", header.rank, current.step)
            self._job_end.go_on()
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
        store = current.store
        needs_init = [b for b in sorted(job.owned) if store.get(b) is None]
        reply = Header(
            msg_type=MsgType.HELLO_OK,
            rank=header.rank,
            step=current.step,
            meta={
                "node_id": self._node_id,
                "owned": sorted(job.owned),
                "needs_init": needs_init,
                "resume_step": resume_step,
                "contributed": contributed,
                "non_finite": self._config.non_finite,  # workers check that every node of the job has the same policy
                "batches": batches,  # small buckets travel several to a message, both ways (transport.batches)
                **({"same_host": self._same_host_address} if self._same_host_address else {}),
            },
        )
        self._send(message.peer, reply)
        if how in ("restarted", "moved"):
            self._rank_rejoined(header.rank)
        return "answered"

    def _register(self, spec: JobSpec, node_index: int) -> None:
        """Rank 0's HELLO of a new job: planned, checked against this node's memory, taken."""
        plan = self._admission.plan_job(spec)
        problem = self._admission.fit_problem(spec, node_index, plan)
        if problem is not None:
            log.error("cannot take the job: %s", problem)
            raise WireError(ErrorCode.CANNOT_FIT, f"node {self._node_id}: {problem}")
        job = ActiveJob.create(spec, node_index, plan)
        self._take_job(job)
        owned = job.owned
        log.info(
            "registered job: %d workers, %d nodes (this is node %d), %d parameters, %d buckets here (%.1f M elements), wire %s, clipping %s, moments %s",
            spec.world_size,
            spec.num_nodes,
            node_index,
            len(spec.params),
            len(owned),
            sum(b.numel for b in owned.values()) / 1e6,
            spec.wire_dtype,
            spec.max_grad_norm,
            describe_moments(spec),
        )

    def _hold_or_morph(self, message: Message, spec: JobSpec, at: int) -> bool:
        """A HELLO of the registered job at another width, to take effect at step ``at``
        (:mod:`optimizer_node.intake.morphing`): held (True) until every owned bucket reached ``at``, then the
        job morphs and the HELLO registers as usual (False)."""
        current = self._current
        job = current.job
        assert job is not None
        if job.spec.mode != "full":
            raise WireError(ErrorCode.BAD_REQUEST, "a layer-wise job cannot change its width: morphing is for full-model jobs")
        store = current.store
        steps = {state.step for state in store}
        if len(store) < len(job.owned) or max(steps, default=0) > at:
            raise WireError(
                ErrorCode.BAD_REQUEST,
                f"node {self._node_id} is at step {current.step}{' (initial values missing)' if len(store) < len(job.owned) else ''}, past or "
                f"not ready for the morph at step {at}: restart the workers at the new width (they resume at the nodes' step)",
            )
        if min(steps, default=0) < at:
            self._morphs.hold(at, message)
            notice = {"waiting_for": f"node {self._node_id} is at step {current.step}; the job changes its width at step {at}"}
            self._send(message.peer, Header(msg_type=MsgType.NOTICE, rank=message.header.rank, meta=notice))
            return True
        self._change_width(spec, at)
        return False

    def _extend_job(self, spec: JobSpec, node_index: int) -> None:
        """Rank 0 added a param group between steps (``add_param_group``): the job takes its
        parameters in buckets after the existing ones, which keep their places and state; the new
        buckets start at the job's current step with zero moments, once rank 0 sends their values."""
        current = self._current
        job = current.job
        assert job is not None
        if current.in_flight:
            raise WireError(ErrorCode.BAD_REQUEST, "a param group can only be added between steps: this node holds gradients of the step in progress")
        plan = self._admission.plan_job(spec)
        problem = self._admission.fit_problem(spec, node_index, plan)
        if problem is not None:
            raise WireError(ErrorCode.CANNOT_FIT, f"node {self._node_id} cannot take the added param group: {problem}")
        base = current.step
        added = len(spec.params) - len(job.spec.params)
        extended = ActiveJob.create(spec, node_index, plan, base_step=base)
        self._take_job(extended)
        log.info("rank 0 added %d parameter(s) in a new param group at step %d: this node now owns %d buckets", added, base, len(extended.owned))

    def _resume_point(self, job: ActiveJob, rank: int) -> tuple[int, list[int]]:
        """Where ``rank`` resumes at this node: see :meth:`StepLedger.resume_point`."""
        store = self._current.store
        steps = {b: state.step for b in job.owned if (state := store.get(b)) is not None}
        if not steps:  # rank 0 has not registered initial values yet (of a new job, or of an added param group)
            return job.base_step, []
        return self._current.ledger.resume_point(rank, steps, self._gradient_received)

    def _gradient_received(self, bucket_id: int, rank: int) -> bool:
        """Whether ``rank``'s gradient of the step in progress of ``bucket_id`` is in."""
        in_flight = self._current.in_flight.get(bucket_id)
        return in_flight is not None and rank in in_flight.reduction.received

    def on_init(self, message: Message) -> None:
        """Rank 0's initial values of one bucket."""
        job = self._ranks.require_rank(message)
        header = message.header
        if header.rank != 0:
            raise WireError(ErrorCode.BAD_REQUEST, "only rank 0 sends initial values")
        bucket = self._admission.owned_bucket(job, header)
        self._admission.check_payload(header, bucket, "float32")
        store = self._current.store
        if store.get(bucket.bucket_id) is not None:
            raise WireError(ErrorCode.BAD_REQUEST, f"bucket {bucket.bucket_id} is already initialized")
        initial = torch.empty(bucket.numel, dtype=torch.float32)
        for offset, view in message.tensors:
            initial[offset : offset + view.numel()].copy_(view)
        store.create(bucket.bucket_id, initial, job.codec(bucket.bucket_id)).step = job.base_step  # an added param group's buckets join at the current step
        if len(store) == len(job.owned):
            self._checkpoints.job_initialized()
        self._send(message.peer, Header(msg_type=MsgType.ACK, bucket_id=bucket.bucket_id))
        state = store.get(bucket.bucket_id)
        assert state is not None
        self._replies.answer_deferred(state, job)
