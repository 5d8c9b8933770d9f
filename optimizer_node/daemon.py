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

Composition: the daemon keeps what is node-wide (the transport and endpoint, the registrar and the
HELLOs it holds, the sends, the store factory, the crash points, the non-finite counts, the clock, the
metrics, the command queue, the pass thread, the serve loop, the dispatch, the echoes); everything
that belongs to one job is a :class:`~optimizer_node.job.NodeJob`, made at the start and anew each
time a job is let go. No part holds the daemon: each is given the narrow things it uses.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from optimizer_node.admin.operator import NodeOperator
from optimizer_node.config import NodeConfig
from optimizer_node.control import CommandQueue, StepClock
from optimizer_node.data_plane import bind_data_plane
from optimizer_node.dispatch import MessageDispatch
from optimizer_node.faults import CrashPoints
from optimizer_node.intake.non_finite import NonFiniteStats
from optimizer_node.intake.registration import JobRegistrar
from optimizer_node.intake.waiting_hellos import WaitingHellos
from optimizer_node.job import NodeJob, NodeParts
from optimizer_node.job_state import ActiveJob
from optimizer_node.log_limits import RateLimitedLog
from optimizer_node.metrics import NodeMetrics
from optimizer_node.serve_loop import ServeLoop
from optimizer_node.serving.echoes import EchoReplies
from optimizer_node.serving.outgoing import Outgoing
from optimizer_node.serving.reply_budget import UnregisteredReplyBudget
from optimizer_node.state.ooc_store import OutOfCoreStore
from optimizer_node.state.storage import BucketStore, InMemoryStore
from optimizer_node.update.bucket_apply import BucketApply, PendingUpdate
from optimizer_node.update.pass_thread import PassThread, shorten_switch_interval
from transport.interface import Message
from transport.wire import MsgType

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class AdminHandle:
    """How the admin service reaches a node from gRPC's threads: ``call`` runs a function on the
    node's thread (:class:`~optimizer_node.control.CommandQueue`), between two messages; the other
    callables may only run there, inside ``call``. ``clock``: the node's step clock, whose watchers
    are thread-safe."""

    node_id: str
    clock: StepClock
    call: Callable[[Callable[[], T], float], T]
    operator: Callable[[], NodeOperator]  # the job's operator of the moment
    step: Callable[[], int]
    request_checkpoint: Callable[[], Future]
    drain: Callable[[], Future]
    request_stop: Callable[[], None]
    let_job_go: Callable[[str], dict]


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
        self.limit_log = RateLimitedLog(log)
        self._stop: threading.Event | None = None
        self._crash_points = CrashPoints(config.crash_at)
        self.non_finite = NonFiniteStats(config.non_finite)  # node-wide: the counts outlive a job
        self.clock = StepClock()  # node-wide: a step's timings, and who follows them
        self.metrics = NodeMetrics(  # the callables run at scrape time, on the metrics thread: plain attribute reads
            self.non_finite,
            workers_last_seen=lambda: [record.last_seen for record in self._job.current.ledger.present()],
            paused=lambda: self._job.operator.pause_reason is not None,
            draining=lambda: self._job.checkpoints.drain_step is not None,
            last_checkpoint_unix=lambda: (self._job.checkpoints.last or {}).get("created_unix"),
            shared_memory=self._endpoint.shared_memory,
            store_io=lambda: self._job.store.io_counters(),
            curve_refused=lambda: key_refusals.count if key_refusals is not None else 0,
            master_bytes_on_board=lambda: self._job.store.master_bytes_on_board(),
            state_at_risk=bool(config.state_at_risk),
            moments=self._moments_and_bytes,
        )
        # every message sent (in order after a peer's batched values; answers to outsiders bounded), and what rejections log
        self._outgoing = Outgoing(
            self._endpoint,
            UnregisteredReplyBudget(config.max_unread_reply_bytes),
            self.limit_log,
            metrics=self.metrics,
            is_rank_connection=lambda peer: self._job.is_rank_connection(peer),
            flush_queued=lambda peer: self._job.flush_queued(peer),
            params_sent=lambda bucket_id, handle: self._job.params_sent(bucket_id, handle),
        )
        # HELLO: the key checked, the HELLOs that came before their rank 0 held, a finished job let go for the next
        self._registrar = JobRegistrar(
            WaitingHellos(config.max_waiting_hellos, config.max_waiting_hello_bytes),
            allow_list,
            node_id=self.node_id,
            take_next_job=config.next_job == "take",
            limit_log=self.limit_log,
            registration=lambda: self._job.registration,
            let_job_go=self.let_job_go,
            handle=self.handle,
            send=self._outgoing.send,
        )
        self.commands = CommandQueue()  # how the admin service reaches this thread
        # --pass-thread: the update passes run on a thread of their own while this one receives and sends
        self._passes: PassThread[PendingUpdate] | None = None
        if config.pass_thread:  # in memory only (config.validate)
            shorten_switch_interval()
            self._passes = PassThread(BucketApply.run)
        # start, messages, updates, stop
        self._serve_loop = ServeLoop(
            config, self._endpoint, self._outgoing, self.commands, self._passes, parts=lambda: self._job.served, handle=self.handle, finish=self._finish
        )
        self.admin_address: str | None = None
        self.metrics_address: str | None = None
        self.started_at = time.time()
        self.jobs_let_go = 0  # jobs this node finished or was reset from, and let go (a node takes the next job)
        self._node_parts = NodeParts(  # what every job is given of the node
            config=config,
            node_id=self.node_id,
            same_host_address=self.same_host_address,
            endpoint=self._endpoint,
            outgoing=self._outgoing,
            limit_log=self.limit_log,
            crash_points=self._crash_points,
            non_finite=self.non_finite,
            clock=self.clock,
            metrics=self.metrics,
            passes=self._passes,
            handle=self.handle,
            node_status=self._node_status,
            jobs_let_go=lambda: self.jobs_let_go,
        )
        self._job = NodeJob(self._node_parts, self._new_store())
        self._echoes = EchoReplies(
            self._endpoint, self._outgoing.send, lambda nbytes: self.metrics.sent(nbytes), max_bytes=config.max_echo_bytes, chunk_bytes=config.chunk_bytes
        )
        handlers = {  # the job's parts (made anew for each job) through lambdas
            MsgType.HELLO: self._registrar.on_hello,
            MsgType.INIT: lambda message: self._job.registration.on_init(message),
            MsgType.PUSH: lambda message: self._job.intake.on_push(message),
            MsgType.PULL: lambda message: self._job.on_pull(message),
            MsgType.CLIP: lambda message: self._job.round_gate.on_clip(message),
            MsgType.QUERY: lambda message: self._job.status.on_query(message),
            MsgType.ECHO: self._echoes.on_echo,
            MsgType.READ_STATE: lambda message: self._job.state_requests.on_read_state(message),
            MsgType.LOAD_STATE: lambda message: self._job.state_requests.on_load_state(message),
            MsgType.BYE: lambda message: self._job.job_end.on_bye(message),
        }
        self._dispatch = MessageDispatch(
            handlers,
            lambda message: self._job.intake.on_batched_push(message),
            check_payload_size=lambda header: self._job.admission.check_payload_size(header),
            is_registered=lambda message: self._job.ranks.is_registered(message),
            settle_for=lambda header, batched: self._job.updates.settle_for(header, batched),
            outgoing=self._outgoing,
            metrics=self.metrics,
            pass_thread=self._passes is not None,
        )
        if config.resume:
            restored = self._job.checkpoints.restore()
            if restored is not None:  # served as the node that registered it served it: board, windows, limits
                self._job.take_job(restored)
                self.metrics.step_reached(self.step)
        elif config.checkpoint_dir:  # now, so that a node killed before its first checkpoint can be restarted with --resume
            self._job.checkpoints.make_directory()

    def _moments_and_bytes(self) -> tuple[str, int]:
        """The job's moment format and its state bytes (none without a job), for the metrics."""
        job = self._job.current.job
        return ("", 0) if job is None else (job.spec.moments, job.state_bytes)

    def _new_store(self) -> BucketStore:
        if self.config.state_dir:
            assert self.config.memory_budget is not None
            config = self.config
            return OutOfCoreStore(config.state_dir, config.memory_budget, io_threads=config.state_io_threads, sync=config.sync_state_writes)
        return InMemoryStore()

    def _node_status(self) -> dict:
        """What an operator's status says of the node itself (the job's operator adds the job's)."""
        return {
            "node_id": self.node_id,
            "data_address": self.address,
            "uptime_s": time.time() - self.started_at,
            "last_step": self.clock.last,
            "non_finite": self.non_finite.snapshot(),
            "jobs_let_go": self.jobs_let_go,
            "state_at_risk": self.config.state_at_risk,
        }

    # ---------------------------------------------------------------- lifecycle

    def serve(self, stop: threading.Event) -> None:
        """Handle messages until ``stop`` is set, then release the endpoint (:class:`~optimizer_node.serve_loop.ServeLoop`)."""
        self._stop = stop
        ready = {"data": self.address, "node_id": self.node_id}
        if self.same_host_address:
            ready["same_host"] = self.same_host_address
        if self.admin_address:
            ready["admin"] = self.admin_address
        if self.metrics_address:
            ready["metrics"] = f"http://{self.metrics_address}/metrics"
        self._serve_loop.run(stop, ready)
        log.info("node %s stopped at step %s", self.node_id, self.step)

    def _finish(self) -> None:
        """Once the serve loop stopped: the job's last state checkpointed, the watchers let go, the node closed."""
        self._job.checkpoints.on_exit()
        self.clock.close()
        self.close()

    def close(self) -> None:
        if self._passes is not None:
            self._job.updates.settle()
            self._passes.close()
        self._endpoint.close()
        self._transport.close()
        self._job.store.close()

    @property
    def step(self) -> int:
        """The step every owned bucket has reached (0 before registration)."""
        return self._job.current.step

    @property
    def active_job(self) -> ActiveJob | None:
        """The registered job (None before registration)."""
        return self._job.current.job

    @property
    def operator(self) -> NodeOperator:
        """What an operator set for the job of the moment and can see (node thread only)."""
        return self._job.operator

    @property
    def finished_step(self) -> int | None:
        """The step at which every rank said BYE, ending the job; ``None`` while it runs."""
        return self._job.job_end.finished_step

    def request_stop(self) -> None:
        """Stop the serve loop after the current message."""
        if self._stop is not None:
            self._stop.set()

    def admin_handle(self) -> AdminHandle:
        """What the admin service may ask of this node, from its own threads."""
        return AdminHandle(
            node_id=self.node_id,
            clock=self.clock,
            call=self.commands.call,
            operator=lambda: self._job.operator,
            step=lambda: self.step,
            request_checkpoint=self.request_checkpoint,
            drain=self.drain,
            request_stop=self.request_stop,
            let_job_go=self.let_job_go,
        )

    # ---------------------------------------------------------------- checkpoints (the admin service's calls)

    def checkpoint(self, origin: str = "automatic") -> dict:
        """Write a checkpoint now (see :meth:`Checkpoints.checkpoint`)."""
        return self._job.checkpoints.checkpoint(origin)

    def request_checkpoint(self) -> Future:
        """A checkpoint now if between steps, else at the end of the step in flight."""
        return self._job.checkpoints.request()

    def drain(self) -> Future:
        """Finish the step in flight, checkpoint, and accept no gradient of a later step."""
        return self._job.checkpoints.drain()

    # ---------------------------------------------------------------- one job after another

    def let_job_go(self, reason: str) -> dict:
        """Drop the registered job (its state, ranks, overrides) so the node takes the next one, as if
        just started. With a checkpoint directory, the job's last state is checkpointed first (between
        steps) and its checkpoints move to ``finished/<job>-step-<step>/`` there, where ``--resume`` no
        longer looks (:func:`~optimizer_node.state.checkpoint.archive_checkpoints`). The job's ranks still
        connected are told; their next message is refused. Returns what was let go."""
        old = self._job
        job = old.current.job
        if job is None:
            return {"job": "", "step": 0, "archived": ""}
        fingerprint, step, archived = old.job_end.let_go(job, reason)
        old.store.close()
        if old.step_end.gc_frozen:
            gc.unfreeze()
        self._job = NodeJob(self._node_parts, self._new_store())
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
