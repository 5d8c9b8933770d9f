"""One job on a node: :class:`NodeJob` owns the parts that belong to the job, made anew for each.

The daemon (:class:`~optimizer_node.daemon.NodeDaemon`) keeps what is node-wide and hands a job only
the node-wide parts it uses (:class:`NodeParts`: the sends, the clock, the metrics, the limits on
outsiders). The job's parts are built here, in one place, and each is given the narrow things it
uses: where the job stands (:class:`~optimizer_node.job_state.CurrentJob`, state only), the peer
parts it calls, and callables. None of them holds the job or the daemon.

Who calls whom, within a job: a push goes in (intake), a complete bucket goes through the round gate
into the update queue, an updated bucket goes out (delivery) and ends the step (step end: the
checkpoint, the job's end, a morph). The operator owns the pause: the queue and the round gate are
given ``paused()``, a read of it; the operator is given ``release_held`` (the gate, then the queue),
which applies the updates held once resumed. Neither side holds the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from optimizer_node.admin.operator import NodeOperator
from optimizer_node.admin.overrides import OperatorOverrides
from optimizer_node.intake.admission import JobAdmission
from optimizer_node.intake.gradients import GradientIntake, IntakeParts
from optimizer_node.intake.morphing import MorphGate
from optimizer_node.intake.rank_check import RankCheck
from optimizer_node.intake.registration import JobRegistration
from optimizer_node.intake.step_ledger import StepLedger
from optimizer_node.job_end import JobEnd
from optimizer_node.job_state import ActiveJob, CurrentJob
from optimizer_node.serve_loop import ServedParts
from optimizer_node.serving.delivery import BucketDelivery
from optimizer_node.serving.replies import ParameterReplies
from optimizer_node.serving.status_replies import StatusReplies
from optimizer_node.state.persistence import Checkpoints
from optimizer_node.state.transfer import StateRequests
from optimizer_node.step_end import StepEnd
from optimizer_node.update.bucket_apply import BucketApply, PendingUpdate
from optimizer_node.update.clipping import GlobalNormRound
from optimizer_node.update.path_choice import UpdatePathChoice
from optimizer_node.update.queue import UpdateQueue
from optimizer_node.update.round_gate import RoundGate
from protos.job.spec import JobSpec
from transport.wire import Header, MsgType

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from optimizer_node.config import NodeConfig
    from optimizer_node.control import StepClock
    from optimizer_node.faults import CrashPoints
    from optimizer_node.intake.non_finite import NonFiniteStats
    from optimizer_node.log_limits import RateLimitedLog
    from optimizer_node.metrics import NodeMetrics
    from optimizer_node.serving.outgoing import Outgoing
    from optimizer_node.state.storage import BucketStore
    from optimizer_node.update.pass_thread import PassThread
    from transport.interface import Message, SendHandle, ServerEndpoint


@dataclass(frozen=True, slots=True)
class NodeParts:
    """The node-wide parts a job uses, made once by the daemon.

    ``handle``: the node's handling of a message (a morph HELLO held for its step);
    ``node_status``: what an operator's status says of the node itself; ``jobs_let_go``: how many jobs
    the node let go so far."""

    config: NodeConfig
    node_id: str
    same_host_address: str | None
    endpoint: ServerEndpoint
    outgoing: Outgoing
    limit_log: RateLimitedLog
    crash_points: CrashPoints
    non_finite: NonFiniteStats
    clock: StepClock
    metrics: NodeMetrics
    passes: PassThread[PendingUpdate] | None
    handle: Callable[[Message], None]
    node_status: Callable[[], dict]
    jobs_let_go: Callable[[], int]


class NodeJob:
    """Everything that belongs to one job, as a node that has none has it: built at the node's start
    and when the node lets a job go for the next. ``store``: the job's bucket states (a new store for
    each job)."""

    def __init__(self, node: NodeParts, store: BucketStore) -> None:
        config, send = node.config, node.outgoing.send
        self.current = current = CurrentJob(store)  # the job, its ranks, its bucket states, its steps in flight
        self.ranks = ranks = RankCheck(current, node.limit_log, jobs_let_go=node.jobs_let_go)  # who may send what
        self.norm_round = GlobalNormRound(node.non_finite, skip_policy=config.non_finite == "skip")  # clipping's global norm, and skipping a step
        self.replies = replies = ParameterReplies(  # PULL and PARAMS: pulls waiting for their step, batches of small buckets, the board
            config,
            store,
            node.endpoint,
            send,
            node.metrics.sent,
            same_host_address=node.same_host_address,
            batch_params=config.batch_params,
        )
        self.admission = JobAdmission(config, node.node_id, node.endpoint, node.limit_log)  # what the job and its messages are checked against
        self.overrides = overrides = OperatorOverrides()  # hyperparameter overrides and the clipping threshold an operator set, with their origins
        self.checkpoints = checkpoints = Checkpoints(config, node.crash_points, current, overrides, node.node_id)  # asked for, drain, the last one
        # BYE: the step at which every rank left, between steps; and the job's side of being let go
        self.job_end = job_end = JobEnd(config, current, ranks, replies, checkpoints, overrides, send=send, tell_workers=self.tell_workers)
        self.morphs = morphs = MorphGate()  # the job's width changes, and morph HELLOs that came early
        # every owned bucket reached a step: its timings, a due checkpoint, the job's end, the agreed morph
        self.step_end = StepEnd(node.handle, node.clock, node.metrics, overrides, checkpoints, job_end, morphs)
        self.update_paths = UpdatePathChoice(enabled=config.compiled_update)  # compiled loop or torch ops: timed on the job's first updates
        retain_previous = config.retain_previous  # the values of a step in flight, for a rank that restarts
        self.bucket_apply = BucketApply(config, store, replies, overrides, self.update_paths, node.clock, retain_previous=retain_previous)
        # what an operator set for this job (the pause, the overrides) and can see; it owns the pause
        self.operator = operator = NodeOperator(
            current,
            overrides,
            checkpoints=checkpoints,
            job_end=job_end,
            morphs=morphs,
            update_paths=self.update_paths,
            tell_workers=self.tell_workers,
            release_held=self.release_held_updates,
            node_status=node.node_status,
        )
        # an updated bucket's values out, and the step's end once every owned bucket reached it
        self.delivery = BucketDelivery(current, replies, node.outgoing, checkpoints, node.clock, node.metrics, node.crash_points, self.step_end)
        # the ready updates, lowest bucket id first, run here or on the pass thread; held while paused or the store fails
        self.updates = UpdateQueue(
            current, self.bucket_apply, self.delivery.deliver, replies.flush, node.passes, paused=lambda: operator.pause_reason is not None
        )
        # a complete bucket's update queued now, or held for the step's global round (NORM_PARTIAL out, CLIP in)
        self.round_gate = RoundGate(
            current,
            self.norm_round,
            ranks,
            self.updates,
            self.delivery,
            send,
            paused=lambda: operator.pause_reason is not None,
            max_grad_norm=lambda: operator.max_grad_norm,
            skip_policy=config.non_finite == "skip",
        )
        self.intake = GradientIntake(  # the steps in flight, and the checks every push passes first
            IntakeParts(
                current,
                ranks,
                self.admission,
                store,
                overrides,
                self.norm_round,
                checkpoints,
                morphs,
                self.bucket_apply,
                node.crash_points,
                config,
                node.non_finite,
                node.metrics,
                node.clock,
            ),
            send=send,
            complete=self.round_gate.gradients_complete,
        )
        # a rank reads a bucket's optimizer state, rank 0 loads one between steps (state_dict, load_state_dict)
        self.state_requests = StateRequests(config, ranks, self.admission, store, replies, node.outgoing, current.in_flight)
        # QUERY: where the job is and what the node waits for, for a worker's diagnosis
        self.status = StatusReplies(
            node.node_id, current, ranks, self.intake, self.norm_round, self.updates, send=send, pause_reason=lambda: operator.pause_reason
        )
        # HELLO (once the node-wide registrar let it through) and INIT
        self.registration = JobRegistration(
            config,
            node.node_id,
            current,
            ranks=ranks,
            admission=self.admission,
            replies=replies,
            morphs=morphs,
            checkpoints=checkpoints,
            job_end=job_end,
            same_host_address=node.same_host_address,
            take_job=self.take_job,
            change_width=self.change_width,
            rank_rejoined=self.rank_rejoined,
            send=send,
        )
        self.served = ServedParts(self.updates, store, replies)  # what the serve loop works with at each turn
        self._send = send

    @property
    def store(self) -> BucketStore:
        """The job's bucket states (parameters, moments, step)."""
        return self.current.store

    def take_job(self, job: ActiveJob) -> None:
        """``job`` is the registered job from now on (a new one, or the registered one with a param
        group added): its payload limit, its parameter board, its workers' gradient windows."""
        self.current.job = job
        self.current.store.expect_buckets([bucket.numel for bucket in job.owned.values()])
        self.admission.limit_payloads(job)
        self.replies.publish_board(job)
        self.admission.size_gradient_windows(job)

    def change_width(self, spec: JobSpec, at: int) -> None:
        """Every owned bucket reached step ``at``: the job goes on at the width ``spec`` says
        (:mod:`optimizer_node.intake.morphing`). What the old width sent of step ``at`` is dropped: none of
        it is applied, none mixed with the new width's gradients."""
        current = self.current
        job = current.job
        assert job is not None
        self.replies.flush()
        dropped = self.intake.drop_all()
        self.updates.clear()
        self.replies.forget_ranks()
        self.norm_round.reset()
        self.delivery.clear()
        current.ledger = StepLedger()  # the old width's ranks are not part of the job any more
        current.job = ActiveJob.create(spec, job.node_index, base_step=job.base_step)  # the same buckets: the plan does not depend on the width
        self.morphs.morphed(at, job.spec.world_size, spec.world_size, dropped)

    def tell_workers(self, meta: dict, *, peers: Iterable[bytes] | None = None, rank: int = -1) -> None:
        """A NOTICE with ``meta`` to ``peers`` (every connection of the job's ranks: ``None``)."""
        current = self.current
        for peer in current.ledger.connections() if peers is None else peers:
            self._send(peer, Header(msg_type=MsgType.NOTICE, rank=rank, step=current.step, meta=meta))

    def release_held_updates(self) -> int:
        """After a pause: apply the updates held (or first ask for the global norm they wait for);
        returns how many buckets were updated now."""
        job = self.current.job
        if job is None:
            return 0
        if self.round_gate.waits and not self.updates.ready:
            self.round_gate.request_norm(job)
        return self.updates.apply_all_ready()

    def rank_rejoined(self, rank: int) -> None:
        """``rank`` is on a new connection (a new process, or the same one reconnecting): what the old
        connection was sent and may have lost is sent again."""
        if rank == 0:
            self.round_gate.resend_share()

    def on_pull(self, message: Message) -> None:
        """A PULL: a bucket's values, now or once it reaches the step asked for."""
        job = self.ranks.require_rank(message)
        self.replies.on_pull(message, job, self.admission.owned_bucket(job, message.header), self.current.ledger)

    def flush_queued(self, peer: bytes) -> None:
        """The values batched for ``peer`` leave now (before anything else is sent to it)."""
        replies = self.replies
        if replies.outbox.holds(peer):
            replies.flush(peer)

    def is_rank_connection(self, peer: bytes) -> bool:
        """Whether ``peer`` is a connection of one of the job's ranks."""
        return self.current.ledger.is_rank_connection(peer)

    def params_sent(self, bucket_id: int, handle: SendHandle) -> None:
        """A PARAMS send of ``bucket_id``'s values: its next update waits for it."""
        state = self.current.store.get(bucket_id)
        if state is not None:
            state.pending_sends.append(handle)
