"""The optimizer-node daemon: wires the transport, the gradient reduction, the AdamW math and the
bucket store together.

One thread owns the server endpoint and all state. Each PUSH is validated completely before it
touches any state, so a rejected message leaves the node exactly as it was. A bucket is ready for its
update as soon as every worker's gradient for it has arrived (no barrier across buckets); only
global-norm clipping waits for all buckets of a step, because the norm needs them all.

Priority: the serve loop (:mod:`optimizer_node.serve_loop`) handles every message already waiting
before it applies ready updates (a few in a row, ``APPLY_BURST``), and it applies the ready bucket
with the lowest id first: the bucket the next forward pass needs first. In full mode the new values
go to every worker at once; in layer-wise mode they go to the workers that asked for that bucket at
that step (PULL with ``at_step``), in the order they asked.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future

from netoptim.job.spec import JobSpec
from optimizer_node.admin.operator import NodeOperator
from optimizer_node.admin.overrides import OperatorOverrides
from optimizer_node.config import NodeConfig
from optimizer_node.control import CommandQueue, StepClock
from optimizer_node.data_plane import bind_data_plane
from optimizer_node.dispatch import MessageDispatch
from optimizer_node.faults import CrashPoints
from optimizer_node.intake.admission import JobAdmission
from optimizer_node.intake.gradients import GradientIntake, IntakeParts
from optimizer_node.intake.morphing import MorphGate
from optimizer_node.intake.non_finite import NonFiniteStats
from optimizer_node.intake.registration import JobRegistrar
from optimizer_node.intake.step_ledger import StepLedger
from optimizer_node.intake.waiting_hellos import WaitingHellos
from optimizer_node.job_end import JobEnd
from optimizer_node.job_state import ActiveJob
from optimizer_node.log_limits import RateLimitedLog
from optimizer_node.metrics import NodeMetrics
from optimizer_node.serve_loop import ServeLoop
from optimizer_node.serving.delivery import BucketDelivery
from optimizer_node.serving.echoes import EchoReplies
from optimizer_node.serving.outgoing import Outgoing
from optimizer_node.serving.replies import ParameterReplies
from optimizer_node.serving.reply_budget import UnregisteredReplyBudget
from optimizer_node.serving.status_replies import StatusReplies
from optimizer_node.state.ooc_store import OutOfCoreStore
from optimizer_node.state.persistence import Checkpoints
from optimizer_node.state.storage import BucketStore, InMemoryStore
from optimizer_node.state.transfer import StateRequests
from optimizer_node.step_end import StepEnd
from optimizer_node.update.bucket_apply import BucketApply, PendingUpdate
from optimizer_node.update.clipping import GlobalNormRound
from optimizer_node.update.pass_thread import PassThread, shorten_switch_interval
from optimizer_node.update.path_choice import UpdatePathChoice
from optimizer_node.update.queue import UpdateQueue
from optimizer_node.update.round_gate import RoundGate
from transport.interface import Message
from transport.wire import Header, MsgType

log = logging.getLogger(__name__)


class NodeDaemon:
    """One optimizer node. Create it, then call :meth:`serve` (blocking) until ``stop`` is set."""

    def __init__(self, config: NodeConfig) -> None:
        config.validate()
        self.config = config
        # with CURVE: which ranks each allowed key may register as, and how many keys were refused
        self._transport, self._endpoint, allow_list, key_refusals = bind_data_plane(config)
        self.address = self._endpoint.address
        self.same_host_address = self._endpoint.bind_same_host() if config.same_host_ipc else None
        self.node_id = config.node_id or self.address
        # HELLO and INIT: registers a job, holds the HELLOs that came before their rank 0, says who may send what
        self._registrar = JobRegistrar(self, WaitingHellos(config.max_waiting_hellos, config.max_waiting_hello_bytes), allow_list)
        self.limit_log = RateLimitedLog(log)
        # every message sent (in order after a peer's batched values; answers to outsiders bounded), and what rejections log
        self._outgoing = Outgoing(self, self._endpoint, UnregisteredReplyBudget(config.max_unread_reply_bytes), self.limit_log)
        self._stop: threading.Event | None = None
        self._store: BucketStore = self._new_store()
        self._crash_points = CrashPoints(config.crash_at)
        self.non_finite = NonFiniteStats(config.non_finite)  # node-wide: the counts outlive a job
        self.clock = StepClock()  # node-wide: a step's timings, and who follows them
        self.metrics = NodeMetrics(  # the callables run at scrape time, on the metrics thread: plain attribute reads
            self.non_finite,
            workers_last_seen=lambda: [record.last_seen for record in self._ledger.present()],
            paused=lambda: self.operator.pause_reason is not None,
            draining=lambda: self._checkpoints.drain_step is not None,
            last_checkpoint_unix=lambda: (self._checkpoints.last or {}).get("created_unix"),
            shared_memory=self._endpoint.shared_memory,
            store_io=lambda: self._store.io_counters(),
            curve_refused=lambda: key_refusals.count if key_refusals is not None else 0,
            master_bytes_on_board=lambda: self._store.master_bytes_on_board(),
        )
        self.commands = CommandQueue()  # how the admin service reaches this thread
        # --pass-thread: the update passes run on a thread of their own while this one receives and sends
        self._passes: PassThread[PendingUpdate] | None = None
        if config.pass_thread:  # in memory only (config.validate)
            shorten_switch_interval()
            self._passes = PassThread(BucketApply.run)
        self._serve_loop = ServeLoop(self, self._endpoint, self._outgoing, self.commands, self._passes)  # start, messages, updates, stop
        self._reset_job_state()
        self._echoes = EchoReplies(
            self._endpoint, self._outgoing.send, lambda nbytes: self.metrics.sent(nbytes), max_bytes=config.max_echo_bytes, chunk_bytes=config.chunk_bytes
        )
        handlers = {  # the job's parts (made anew for each job) through lambdas
            MsgType.HELLO: self._registrar.on_hello,
            MsgType.INIT: self._registrar.on_init,
            MsgType.PUSH: lambda message: self._intake.on_push(message),
            MsgType.PULL: self._on_pull,
            MsgType.CLIP: lambda message: self._round_gate.on_clip(message),
            MsgType.QUERY: lambda message: self._status.on_query(message),
            MsgType.ECHO: self._echoes.on_echo,
            MsgType.READ_STATE: lambda message: self._state_requests.on_read_state(message),
            MsgType.LOAD_STATE: lambda message: self._state_requests.on_load_state(message),
            MsgType.BYE: lambda message: self._job_end.on_bye(message),
        }
        self._dispatch = MessageDispatch(
            self,
            handlers,
            lambda message: self._intake.on_batched_push(message),
            registrar=self._registrar,
            outgoing=self._outgoing,
            metrics=self.metrics,
            pass_thread=self._passes is not None,
        )
        self.admin_address: str | None = None
        self.metrics_address: str | None = None
        self.started_at = time.time()
        self.jobs_let_go = 0  # jobs this node finished or was reset from, and let go (a node takes the next job)
        if config.resume:
            restored = self._checkpoints.restore()
            if restored is not None:  # served as the node that registered it served it: board, windows, limits
                self.take_job(restored)
                self.metrics.step_reached(self.step)
        elif config.checkpoint_dir:  # now, so that a node killed before its first checkpoint can be restarted with --resume
            self._checkpoints.make_directory()

    def _new_store(self) -> BucketStore:
        if self.config.state_dir:
            assert self.config.memory_budget is not None
            config = self.config
            return OutOfCoreStore(config.state_dir, config.memory_budget, io_threads=config.state_io_threads, sync=config.sync_state_writes)
        return InMemoryStore()

    def _reset_job_state(self) -> None:
        """Everything that belongs to one job, as a node that has none has it: at start, and when a
        node lets a job go to take the next (:meth:`let_job_go`). Node-wide state (the endpoint, the
        metrics, the limits on outsiders) is set in ``__init__`` and stays."""
        self._job: ActiveJob | None = None
        self._ledger = StepLedger()  # who each rank is, what it still owes, the values it may need again
        self._norm_round = GlobalNormRound(self.non_finite, skip_policy=self.config.non_finite == "skip")  # clipping's global norm, and skipping a step
        self._replies = ParameterReplies(  # PULL and PARAMS: pulls waiting for their step, batches of small buckets, the board
            self.config,
            self._store,
            self._endpoint,
            self._outgoing.send,
            lambda nbytes: self.metrics.sent(nbytes),
            same_host_address=self.same_host_address,
            batch_params=self.config.batch_params,
        )
        self.admission = JobAdmission(self.config, self.node_id, self._endpoint, self.limit_log)  # what the job and its messages are checked against
        overrides = OperatorOverrides()  # hyperparameter overrides and the clipping threshold an operator set, with their origins
        self._checkpoints = Checkpoints(self.config, self._crash_points, self._store, overrides, self)  # asked for, drain, the last one
        # BYE: the step at which every rank left, between steps; and the job's side of being let go
        self._job_end = JobEnd(self, self.config, self._registrar, self._outgoing, self._replies, self._checkpoints, overrides)
        self._morphs = MorphGate()  # the job's width changes, and morph HELLOs that came early
        # every owned bucket reached a step: its timings, a due checkpoint, the job's end, the agreed morph
        self._step_end = StepEnd(self.handle, self.clock, self.metrics, overrides, self._checkpoints, self._job_end, self._morphs)
        update_paths = UpdatePathChoice(enabled=self.config.compiled_update)  # compiled loop or torch ops: timed on the job's first updates
        retain_previous = self.config.retain_previous  # the values of a step in flight, for a rank that restarts
        self._bucket_apply = BucketApply(self.config, self._store, self._replies, overrides, update_paths, self.clock, retain_previous=retain_previous)
        self._intake = GradientIntake(  # the steps in flight, and the checks every push passes first
            self,
            IntakeParts(
                self._registrar,
                self.admission,
                self._store,
                overrides,
                self._norm_round,
                self._checkpoints,
                self._morphs,
                self._bucket_apply,
                self._crash_points,
            ),
        )
        # an updated bucket's values out, and the step's end once every owned bucket reached it
        self._delivery = BucketDelivery(
            self, self._intake.in_flight, self._replies, self._outgoing, self._checkpoints, self.clock, self.metrics, self._crash_points, self._step_end
        )
        # a rank reads a bucket's optimizer state, rank 0 loads one between steps (state_dict, load_state_dict)
        self._state_requests = StateRequests(self.config, self._registrar, self.admission, self._store, self._replies, self._outgoing, self._intake.in_flight)
        # the ready updates, lowest bucket id first, run here or on the pass thread; held while paused or the store fails
        deliver = self._delivery.deliver
        self._updates = UpdateQueue(self, self._store, self._bucket_apply, self._intake.in_flight, deliver, self._flush_outbox, self._passes)
        # a complete bucket's update queued now, or held for the step's global round (NORM_PARTIAL out, CLIP in)
        self._round_gate = RoundGate(self, self._norm_round, self._registrar, self._intake.in_flight, self._updates, self._delivery, self._outgoing.send)
        # QUERY: where the job is and what the node waits for, for a worker's diagnosis
        self._status = StatusReplies(self, self._registrar, self._outgoing, self._intake, self._norm_round, self._store, self._updates)
        # what an operator set for this job (the pause, the overrides) and can see
        self.operator = NodeOperator(self, overrides, store=self._store, checkpoints=self._checkpoints, morphs=self._morphs, update_paths=update_paths)

    # ---------------------------------------------------------------- lifecycle

    def serve(self, stop: threading.Event) -> None:
        """Handle messages until ``stop`` is set, then release the endpoint (:class:`~optimizer_node.serve_loop.ServeLoop`)."""
        self._stop = stop
        self._serve_loop.run(stop)

    def close(self) -> None:
        if self._passes is not None:
            self._updates.settle()
            self._passes.close()
        self._endpoint.close()
        self._transport.close()
        self._store.close()

    @property
    def step(self) -> int:
        """The step every owned bucket has reached (0 before registration)."""
        states = list(self._store)
        return min((state.step for state in states), default=0)

    @property
    def active_job(self) -> ActiveJob | None:
        """The registered job (None before registration)."""
        return self._job

    def between_steps(self) -> bool:
        """Whether every owned bucket is at the same step and no gradient of the next is in."""
        steps = {state.step for state in self._store}
        return self._job is not None and len(steps) <= 1 and not self._intake.in_flight and len(self._store) == len(self._job.owned)

    def request_stop(self) -> None:
        """Stop the serve loop after the current message."""
        if self._stop is not None:
            self._stop.set()

    # ---------------------------------------------------------------- what the operator reads and asks (operator.py)

    @property
    def ledger(self) -> StepLedger:
        """Who each rank of the job is (a new ledger when the job changes its width)."""
        return self._ledger

    @property
    def finished_step(self) -> int | None:
        """The step at which every rank said BYE, ending the job; ``None`` while it runs."""
        return self._job_end.finished_step

    # ---------------------------------------------------------------- what registration reads and asks (registration.py)

    @property
    def store(self) -> BucketStore:
        """The job's bucket states (parameters, moments, step)."""
        return self._store

    @property
    def replies(self) -> ParameterReplies:
        return self._replies

    @property
    def morphs(self) -> MorphGate:
        return self._morphs

    @property
    def checkpoints(self) -> Checkpoints:
        return self._checkpoints

    @property
    def updates(self) -> UpdateQueue:
        """The job's ready updates (read by the serve loop and the dispatch)."""
        return self._updates

    def take_job(self, job: ActiveJob) -> None:
        """``job`` is the registered job from now on (a new one, or the registered one with a param
        group added): its payload limit, its parameter board, its workers' gradient windows."""
        self._job = job
        self._store.expect_buckets([bucket.numel for bucket in job.owned.values()])
        self.admission.limit_payloads(job)
        self._replies.publish_board(job)
        self.admission.size_gradient_windows(job)

    def change_width(self, spec: JobSpec, at: int) -> None:
        """Every owned bucket reached step ``at``: the job goes on at the width ``spec`` says
        (:mod:`optimizer_node.intake.morphing`). What the old width sent of step ``at`` is dropped: none of
        it is applied, none mixed with the new width's gradients."""
        job = self._job
        assert job is not None
        self._flush_outbox()
        dropped = self._intake.drop_all()
        self._updates.clear()
        self._replies.forget_ranks()
        self._norm_round.reset()
        self._delivery.clear()
        self._ledger = StepLedger()  # the old width's ranks are not part of the job any more
        self._job = ActiveJob.create(spec, job.node_index, base_step=job.base_step)  # the same buckets: the plan does not depend on the width
        self._morphs.morphed(at, job.spec.world_size, spec.world_size, dropped)

    def go_on_after_finish(self) -> None:
        """A rank of the finished job said HELLO again: the job is not over."""
        self._job_end.go_on()

    def gradient_received(self, bucket_id: int, rank: int) -> bool:
        """Whether ``rank``'s gradient of the step in progress of ``bucket_id`` is in."""
        in_flight = self._intake.in_flight.get(bucket_id)
        return in_flight is not None and rank in in_flight.reduction.received

    def gradients_in_flight(self) -> bool:
        """Whether any gradient of a step in progress is in."""
        return bool(self._intake.in_flight)

    def reply(self, peer: bytes, header: Header) -> None:
        """A message without payload to ``peer``."""
        self._outgoing.send(peer, header)

    def tell_workers(self, meta: dict, *, peers: Iterable[bytes] | None = None, rank: int = -1) -> None:
        """A NOTICE with ``meta`` to ``peers`` (every connection of the job's ranks: ``None``)."""
        for peer in self._ledger.connections() if peers is None else peers:
            self._outgoing.send(peer, Header(msg_type=MsgType.NOTICE, rank=rank, step=self.step, meta=meta))

    def release_held_updates(self) -> int:
        """After a pause: apply the updates held (or first ask for the global norm they wait for);
        returns how many buckets were updated now."""
        job = self._job
        if job is None:
            return 0
        if self._round_gate.waits and not self._updates.ready:
            self._round_gate.request_norm(job)
        return self._updates.apply_all_ready()

    # ---------------------------------------------------------------- checkpoints (the admin service's calls)

    def checkpoint(self, origin: str = "automatic") -> dict:
        """Write a checkpoint now (see :meth:`Checkpoints.checkpoint`)."""
        return self._checkpoints.checkpoint(origin)

    def request_checkpoint(self) -> Future:
        """A checkpoint now if between steps, else at the end of the step in flight."""
        return self._checkpoints.request()

    def drain(self) -> Future:
        """Finish the step in flight, checkpoint, and accept no gradient of a later step."""
        return self._checkpoints.drain()

    # ---------------------------------------------------------------- one job after another

    def let_job_go(self, reason: str) -> dict:
        """Drop the registered job (its state, ranks, overrides) so the node takes the next one, as if
        just started. With a checkpoint directory, the job's last state is checkpointed first (between
        steps) and its checkpoints move to ``finished/<job>-step-<step>/`` there, where ``--resume`` no
        longer looks (:func:`~optimizer_node.state.checkpoint.archive_checkpoints`). The job's ranks still
        connected are told; their next message is refused. Returns what was let go."""
        job = self._job
        if job is None:
            return {"job": "", "step": 0, "archived": ""}
        fingerprint, step, archived = self._job_end.let_go(job, reason)
        self._store.close()
        if self._step_end.gc_frozen:
            gc.unfreeze()
        self._store = self._new_store()
        self._reset_job_state()  # after the new store: the job's parts are given it
        self._endpoint.unlimit_payload()
        self._endpoint.drop_board()
        self._endpoint.size_inboxes(0)  # windows of the window size again, until the next job is registered
        self.metrics.step_reached(0)
        self.jobs_let_go += 1
        log.warning("let job %s go at step %d (%s)%s", fingerprint, step, reason, f"; its checkpoints are in {archived}" if archived else "")
        return {"job": fingerprint, "step": step, "archived": str(archived or "")}

    # ---------------------------------------------------------------- dispatch

    def handle(self, message: Message) -> None:
        """Handle one validated message (:class:`~optimizer_node.dispatch.MessageDispatch`)."""
        self._dispatch.handle(message)

    def _on_pull(self, message: Message) -> None:
        job = self._registrar.require_rank(message)
        self._replies.on_pull(message, job, self.admission.owned_bucket(job, message.header), self._ledger)

    def _flush_outbox(self, peer: bytes | None = None) -> None:
        """Send the batched new values waiting for ``peer`` (every peer: ``None``)."""
        self._replies.flush(peer)

    # ---------------------------------------------------------------- gradients in (gradient_intake.py)

    def gradients_complete(self, job: ActiveJob, bucket_id: int, step: int) -> None:
        """Every rank's gradient of ``bucket_id`` at ``step`` is in (:class:`~optimizer_node.update.round_gate.RoundGate`)."""
        self._round_gate.gradients_complete(job, bucket_id, step)

    def rank_rejoined(self, rank: int) -> None:
        """``rank`` is on a new connection (a new process, or the same one reconnecting): what the old
        connection was sent and may have lost is sent again."""
        if rank == 0:
            self._round_gate.resend_share()
