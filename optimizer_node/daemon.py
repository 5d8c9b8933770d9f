"""The optimizer-node daemon: wires the transport, the gradient reduction, the AdamW math and the
bucket store together.

One thread owns the server endpoint and all state. Each PUSH is validated completely before it
touches any state, so a rejected message leaves the node exactly as it was. A bucket is ready for its
update as soon as every worker's gradient for it has arrived (no barrier across buckets); only
global-norm clipping waits for all buckets of a step, because the norm needs them all.

Priority: the serve loop handles every message already waiting before it applies ready updates (a
few in a row, ``APPLY_BURST``), and it applies the ready bucket with the lowest id first: the bucket the next forward pass needs
first. In full mode the new values go to every worker at once; in layer-wise mode they go to the
workers that asked for that bucket at that step (PULL with ``at_step``), in the order they asked.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path

from job.spec import JobSpec
from optimizer_node.admission import JobAdmission, job_fingerprint
from optimizer_node.bucket_apply import BucketApply, PendingUpdate
from optimizer_node.checkpoint import archive_checkpoints
from optimizer_node.clipping import GlobalNormRound
from optimizer_node.config import NodeConfig
from optimizer_node.control import CommandQueue, StepClock
from optimizer_node.delivery import BucketDelivery
from optimizer_node.echoes import EchoReplies
from optimizer_node.faults import CrashPoints
from optimizer_node.gradient_intake import GradientIntake, IntakeParts
from optimizer_node.job_state import ActiveJob
from optimizer_node.log_limits import RateLimitedLog
from optimizer_node.metrics import NodeMetrics
from optimizer_node.morphing import MorphGate
from optimizer_node.non_finite import NonFiniteStats
from optimizer_node.ooc_store import OutOfCoreStore
from optimizer_node.operator import NodeOperator
from optimizer_node.outgoing import Outgoing
from optimizer_node.overrides import OperatorOverrides
from optimizer_node.pass_thread import PassThread, shorten_switch_interval
from optimizer_node.persistence import Checkpoints
from optimizer_node.registration import JobRegistrar, load_allow_list
from optimizer_node.replies import ParameterReplies
from optimizer_node.reply_budget import UnregisteredReplyBudget
from optimizer_node.state_transfer import StateRequests
from optimizer_node.step_ledger import StepLedger
from optimizer_node.storage import BucketStore, InMemoryStore
from optimizer_node.update_path_choice import UpdatePathChoice
from optimizer_node.update_queue import UpdateQueue
from optimizer_node.waiting_hellos import WaitingHellos
from transport import create_transport
from transport.interface import Message
from transport.security import CurveServerConfig
from transport.wire import ErrorCode, Header, MsgType, WireError

log = logging.getLogger(__name__)

APPLY_BURST = 8
"""Ready updates applied in a row before the serve loop looks for messages again."""

PASS_POLL_S = 0.001
"""With passes on their own thread and an endpoint that cannot be woken by it: how often the serve
loop looks for finished passes while it waits for messages."""


class NodeDaemon:
    """One optimizer node. Create it, then call :meth:`serve` (blocking) until ``stop`` is set."""

    def __init__(self, config: NodeConfig) -> None:
        config.validate()
        self.config = config
        curve = CurveServerConfig(config.curve_secret_key, config.curve_allow) if config.curve_secret_key and config.curve_allow else None
        self._transport = create_transport(
            config.listen,
            max_message_bytes=config.max_message_bytes,
            chunk_bytes=config.chunk_bytes,
            curve_server=curve,
            io_threads=config.io_threads,
            **config.endpoint_limits(),
        )
        self._endpoint = self._transport.bind(config.listen)
        try:  # which ranks each allowed key may register as; a bad allow-list file stops the start
            allow_list = load_allow_list(curve.allowed_keys_dir) if curve is not None else None
        except Exception:
            self._endpoint.close()
            self._transport.close()
            raise
        self.address = self._endpoint.address
        self.same_host_address = self._endpoint.bind_same_host() if config.same_host_ipc else None
        self.node_id = config.node_id or self.address
        out_of_core = bool(config.state_dir)
        # Previous values are kept in memory; an out-of-core node would need its budget again for them.
        self._retain_previous = not out_of_core
        # The compiled update loop brings numba and LLVM, ~140 MB of RSS: not for a node held to a memory budget.
        self._compiled_update = not out_of_core
        # Out of core, a bucket's tensors go back to the store's pool once released: values must leave at once.
        self._batch_params = not out_of_core
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
        )
        # --pass-thread: the update passes run on a thread of their own while this one receives and sends
        self._passes: PassThread[PendingUpdate] | None = None
        self._woken_by_passes = False
        if config.pass_thread:  # in memory only (config.validate)
            shorten_switch_interval()
            self._passes = PassThread(BucketApply.run)
            self._woken_by_passes = self._endpoint.wake_on(self._passes.wake_fd)
        self._reset_job_state()
        self._echoes = EchoReplies(
            self._endpoint, self._outgoing.send, lambda nbytes: self.metrics.sent(nbytes), max_bytes=config.max_echo_bytes, chunk_bytes=config.chunk_bytes
        )
        self._handlers = {  # built once: handle() runs for every message
            MsgType.HELLO: self._registrar.on_hello,
            MsgType.INIT: self._registrar.on_init,
            MsgType.PUSH: self._on_push,
            MsgType.PULL: self._on_pull,
            MsgType.CLIP: self._on_clip,
            MsgType.QUERY: self._on_query,
            MsgType.ECHO: self._echoes.on_echo,
            MsgType.READ_STATE: lambda message: self._state_requests.on_read_state(message),  # the job's, made anew for each job
            MsgType.LOAD_STATE: lambda message: self._state_requests.on_load_state(message),
            MsgType.BYE: self._on_bye,
        }
        self.commands = CommandQueue()  # how the admin service reaches this thread
        self.admin_address: str | None = None
        self.metrics_address: str | None = None
        self.started_at = time.time()
        self.jobs_let_go = 0  # jobs this node finished or was reset from, and let go (a node takes the next job)
        if config.resume:
            self._job = self._checkpoints.restore()
            if self._job is not None:
                self._store.expect_buckets([bucket.numel for bucket in self._job.owned.values()])
                self.admission.limit_payloads(self._job)
                self.metrics.step_reached(self.step)
        elif config.checkpoint_dir:  # now, so that a node killed before its first checkpoint can be restarted with --resume
            try:
                Path(config.checkpoint_dir).mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # as a failing checkpoint: said, and training goes on
                log.error("cannot create the checkpoint directory %s (%s): checkpoints will fail until it can be written", config.checkpoint_dir, exc)

    def _new_store(self) -> BucketStore:
        if self.config.state_dir:
            assert self.config.memory_budget is not None
            return OutOfCoreStore(self.config.state_dir, self.config.memory_budget, sync=self.config.sync_state_writes)
        return InMemoryStore()

    def _reset_job_state(self) -> None:
        """Everything that belongs to one job, as a node that has none has it: at start, and when a
        node lets a job go to take the next (:meth:`let_job_go`). Node-wide state (the endpoint, the
        metrics, the limits on outsiders) is set in ``__init__`` and stays."""
        self._job: ActiveJob | None = None
        self._ledger = StepLedger()  # who each rank is, what it still owes, the values it may need again
        self._norm_round = GlobalNormRound(self.non_finite, skip_policy=self.config.non_finite == "skip")  # clipping's global norm, and skipping a step
        self._gc_frozen = False
        self._replies = ParameterReplies(  # PULL and PARAMS: pulls waiting for their step, batches of small buckets, the board
            self.config,
            self._store,
            self._endpoint,
            self._outgoing.send,
            lambda nbytes: self.metrics.sent(nbytes),
            same_host_address=self.same_host_address,
            batch_params=self._batch_params,
        )
        self.admission = JobAdmission(self.config, self.node_id, self._endpoint, self.limit_log)  # what the job and its messages are checked against
        overrides = OperatorOverrides()  # hyperparameter overrides and the clipping threshold an operator set, with their origins
        self._checkpoints = Checkpoints(self.config, self._crash_points, self._store, overrides, self)  # asked for, drain, the last one
        self._finished_step: int | None = None  # every rank said BYE between steps: the job is over at this step
        self._morphs = MorphGate()  # the job's width changes, and morph HELLOs that came early
        update_paths = UpdatePathChoice(enabled=self._compiled_update)  # compiled loop or torch ops: timed on the job's first updates
        self._bucket_apply = BucketApply(self.config, self._store, self._replies, overrides, update_paths, self.clock, retain_previous=self._retain_previous)
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
            self, self._intake.in_flight, self._replies, self._outgoing, self._checkpoints, self.clock, self.metrics, self._crash_points
        )
        # a rank reads a bucket's optimizer state, rank 0 loads one between steps (state_dict, load_state_dict)
        self._state_requests = StateRequests(self.config, self._registrar, self.admission, self._store, self._replies, self._outgoing, self._intake.in_flight)
        # the ready updates, lowest bucket id first, run here or on the pass thread; held while paused or the store fails
        deliver = self._delivery.deliver
        self._updates = UpdateQueue(self, self._store, self._bucket_apply, self._intake.in_flight, deliver, self._flush_outbox, self._passes)
        # what an operator set for this job (the pause, the overrides) and can see
        self.operator = NodeOperator(self, overrides, store=self._store, checkpoints=self._checkpoints, morphs=self._morphs, update_paths=update_paths)

    # ---------------------------------------------------------------- lifecycle

    def write_ready_file(self) -> None:
        """Write the ready file atomically, so a reader never sees half of it."""
        if not self.config.ready_file:
            return
        tmp = f"{self.config.ready_file}.tmp"
        with open(tmp, "w") as handle:
            ready = {"data": self.address, "pid": os.getpid(), "node_id": self.node_id}
            if self.same_host_address:
                ready["same_host"] = self.same_host_address
            if self.admin_address:
                ready["admin"] = self.admin_address
            if self.metrics_address:
                ready["metrics"] = f"http://{self.metrics_address}/metrics"
            json.dump(ready, handle)
        os.replace(tmp, self.config.ready_file)

    def serve(self, stop: threading.Event) -> None:
        """Handle messages until ``stop`` is set, then release the endpoint."""
        log.info(
            "node %s serving on %s%s", self.node_id, self.address, f" (and {self.same_host_address} for workers on this host)" if self.same_host_address else ""
        )
        if self.config.exposed_without_curve:  # allowed by --insecure; said at every start
            log.warning(
                "INSECURE: the data plane %s is reachable from the network without authentication (--insecure): anyone who reaches it can "
                "read and change the model; use --curve-secret-key/--curve-allow off a trusted network",
                self.address,
            )
        self._stop = stop
        self.write_ready_file()
        try:
            while not stop.is_set():
                updates = self._updates  # a new queue when a job is let go
                updates.finish_ended()
                if self.commands.waiting:
                    updates.settle()  # an admin call sees (and may change) the node between passes
                    self.commands.run_pending()
                    updates = self._updates
                self._store.poll()
                if self._store.last_error is not None:
                    updates.storage_error, self._store.last_error = self._store.last_error, None
                can_apply = updates.can_apply()
                if self._passes is not None and can_apply:
                    # Handed over before any message is read: the pass thread goes from one pass to the
                    # next without waiting for the loop (which then has the messages to itself).
                    updates.hand_over()
                    can_apply = False
                passing = updates.passing
                if self._replies.outbox and not can_apply and not passing:  # no more updates to add to them: the batches leave
                    self._flush_outbox()
                if can_apply:
                    timeout = 0.0
                elif passing and not self._woken_by_passes:
                    timeout = PASS_POLL_S
                else:  # a pass that ends wakes the wait
                    timeout = self.config.poll_interval_s
                try:
                    message = self._endpoint.recv(timeout)
                except WireError as exc:
                    self._outgoing.log_rejected(exc, exc.peer, "rejected a malformed message: %s", exc)
                    if exc.peer is not None:
                        self._outgoing.send_error(exc.peer, exc.code, exc.message)
                    continue
                if message is not None:
                    self.handle(message)
                    continue
                updates.woken()  # by a pass that ended, or by one taken back already: the wake-up drained
                if can_apply:  # a few in a row: a look for messages costs a system call
                    for _ in range(APPLY_BURST):
                        if not updates.apply_next():
                            break
        finally:
            self._updates.settle()
            self._flush_outbox()
            self.commands.run_pending()
            self._checkpoints.on_exit()
            self.clock.close()
            self.close()
        log.info("node %s stopped at step %s", self.node_id, self.step)

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
        return self._finished_step

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
        (:mod:`optimizer_node.morphing`). What the old width sent of step ``at`` is dropped: none of
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
        self._finished_step = None

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
        if self._global_round and not self._updates.ready:
            self._maybe_request_norm(job)
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

    def _on_bye(self, message: Message) -> None:
        """A rank closed its optimizer. When every rank has, between steps, the job is finished."""
        self._registrar.require_rank(message)
        self._ledger.mark_left(message.header.rank)
        self._outgoing.send(message.peer, Header(msg_type=MsgType.ACK, rank=message.header.rank, step=self.step, meta={"bye": True}))
        log.info("rank %d closed its optimizer at step %d", message.header.rank, self.step)
        self._maybe_finished()

    def _maybe_finished(self) -> None:
        job = self._job
        if job is None or self._finished_step is not None or not self._ledger.all_left(job.spec.world_size) or not self.between_steps():
            return
        self._finished_step = self.step
        self._checkpoints.on_exit()  # the final state, as at a node's exit
        log.warning(
            "job %s finished at step %d: all %d ranks closed their optimizers; %s",
            job_fingerprint(job.spec),
            self._finished_step,
            job.spec.world_size,
            "the node takes the next job that says HELLO" if self.config.next_job == "take" else "netoptim admin reset lets the node take another",
        )

    def let_job_go(self, reason: str) -> dict:
        """Drop the registered job (its state, ranks, overrides) so the node takes the next one, as if
        just started. With a checkpoint directory, the job's last state is checkpointed first (between
        steps) and its checkpoints move to ``finished/<job>-step-<step>/`` there, where ``--resume`` no
        longer looks (:func:`~optimizer_node.checkpoint.archive_checkpoints`). The job's ranks still
        connected are told; their next message is refused. Returns what was let go."""
        job = self._job
        if job is None:
            return {"job": "", "step": 0, "archived": ""}
        step, fingerprint = self.step, job_fingerprint(job.spec)
        self._flush_outbox()
        self._checkpoints.on_exit()
        archived = archive_checkpoints(Path(self.config.checkpoint_dir), f"job-{fingerprint}-step-{step:010d}") if self.config.checkpoint_dir else None
        self.tell_workers({"job_dropped": f"{reason}; its state at step {step} is {f'in {archived}' if archived else 'gone (no --checkpoint-dir)'}"})
        self._checkpoints.cancel_waiters(reason)
        if self.operator.overrides.origins:
            log.warning("the job's hyperparameter overrides are dropped with it: %s", ", ".join(sorted(self.operator.overrides.origins)))
        self._store.close()
        if self._gc_frozen:
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
        """Handle one validated message; protocol violations are answered with ERROR. A batched PUSH
        is handled bucket by bucket, each as if it had come alone (:mod:`transport.batches`)."""
        header = message.header
        self.metrics.received(header.payload_bytes)
        batched = header.msg_type == MsgType.PUSH and "batch" in header.meta
        if self._passes is not None:  # a message is handled as if no pass ran (update_queue.py)
            self._updates.settle_for(header, batched)
        handler = self._on_batched_push if batched else self._handlers.get(header.msg_type)
        try:
            if handler is None:
                raise WireError(ErrorCode.BAD_REQUEST, f"a node does not accept {header.msg_type.name} messages")
            if not batched:
                self.admission.check_payload_size(header)
            handler(message)
        except WireError as exc:
            self._outgoing.log_rejected(
                exc, message.peer, "rejected %s from rank %s (bucket %s, step %s): %s", header.msg_type.name, header.rank, header.bucket_id, header.step, exc
            )
            self._outgoing.send_error(message.peer, exc.code, exc.message, bucket_id=header.bucket_id, step=header.step)
        except Exception as exc:  # a bug must not take the node and everyone's state down
            log.exception("internal error handling %s", header.msg_type.name)
            # The exception's text may quote the node's state: only a registered rank reads it.
            text = f"{type(exc).__name__}: {exc}" if self._registrar.is_registered(message) else "internal error; the node's log has the details"
            self._outgoing.send_error(message.peer, ErrorCode.INTERNAL, text, bucket_id=header.bucket_id, step=header.step)

    def _on_pull(self, message: Message) -> None:
        job = self._registrar.require_rank(message)
        self._replies.on_pull(message, job, self.admission.owned_bucket(job, message.header), self._ledger)

    def _flush_outbox(self, peer: bytes | None = None) -> None:
        """Send the batched new values waiting for ``peer`` (every peer: ``None``)."""
        self._replies.flush(peer)

    # ---------------------------------------------------------------- gradients in (gradient_intake.py)

    def _on_push(self, message: Message) -> None:
        self._intake.on_push(message)

    def _on_batched_push(self, message: Message) -> None:
        self._intake.on_batched_push(message)

    def gradients_complete(self, job: ActiveJob, bucket_id: int, step: int) -> None:
        """Every rank's gradient of ``bucket_id`` at ``step`` is in: its update is ready, or waits for
        the step's global round."""
        if self._global_round:
            self._delivery.tell_consumed(job, bucket_id, step)  # the round holds every sum until the norm is known
            self._maybe_request_norm(job)
        else:
            self._updates.push(bucket_id)

    def _maybe_request_norm(self, job: ActiveJob) -> None:
        """Once every owned bucket's gradient is summed, send this node's share of the norm to rank 0."""
        if (
            self.operator.pause_reason is None and self._norm_round.share(job, self._intake.in_flight, self.operator.max_grad_norm) is not None
        ):  # else resume() asks again
            self._send_norm_partial()

    def _send_norm_partial(self) -> None:
        self._norm_round.resend(self._ledger.peer(0), self._outgoing.send)

    def _on_clip(self, message: Message) -> None:
        self._registrar.require_rank(message)
        self._norm_round.on_clip(message.header, self._intake.in_flight, self._updates.ready, self.operator.max_grad_norm)

    @property
    def _global_round(self) -> bool:
        """Whether a step's updates wait for the round across all buckets and nodes: for the global
        gradient norm (clipping), or for the agreement to skip a step with a non-finite gradient."""
        return self.operator.max_grad_norm is not None or self.config.non_finite == "skip"

    def finish_step(self, step: int) -> None:
        """Every owned bucket reached ``step``: the step's timings, and its checkpoint if one is due."""
        if not self._gc_frozen:  # the job's long-lived objects (states, plan, tensors): out of the collector's scans
            gc.freeze()
            self._gc_frozen = True
        self.clock.step_completed(step)
        self.metrics.step_completed(self.clock.last, step)
        self.operator.overrides.step_begins()
        self._checkpoints.step_completed(step)
        self._maybe_finished()  # a rank's BYE can overtake its last pushes (on another of its connections)
        self._morphs.update_sent()
        for held in self._morphs.due(step):  # the workers agreed to morph at this step
            self.handle(held)

    def rank_rejoined(self, rank: int) -> None:
        """``rank`` is on a new connection (a new process, or the same one reconnecting): what the old
        connection was sent and may have lost is sent again."""
        if rank == 0:
            self._send_norm_partial()

    # ---------------------------------------------------------------- diagnostics

    def _on_query(self, message: Message) -> None:
        if not self._registrar.is_registered(message):
            # All a worker that is not (or no longer) registered needs for its diagnosis: is there a
            # job, and is this connection part of it. The job's state is for its ranks only.
            self._outgoing.send(message.peer, Header(msg_type=MsgType.STATUS, meta={"registered": self._job is not None, "rank_registered": False}))
            return
        missing = self._intake.missing()
        meta = {
            "node_id": self.node_id,
            "registered": self._job is not None,
            "step": self.step,
            "connected_ranks": sorted(self._ledger.ranks),
            "missing": missing,
            "awaiting_clip": self._norm_round.awaiting,
            "uninitialized": sorted(b for b in (self._job.owned if self._job else {}) if self._store.get(b) is None),
            "paused": self.operator.pause_reason,
            "storage_error": self._updates.storage_error,
        }
        self._outgoing.send(message.peer, Header(msg_type=MsgType.STATUS, step=self.step, meta=meta))
