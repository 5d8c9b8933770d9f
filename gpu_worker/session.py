"""A worker's connections to the optimizer nodes of its job.

:class:`OffloadSession` registers the layout, pushes gradient buckets and installs the values the
nodes send back. In full mode (:meth:`connect` + :meth:`finish_step`, or its two halves) every bucket
comes back after every step; in layer-wise mode the caller asks for buckets when it needs them (:meth:`request`) and
handles their arrival itself (``on_params``). It knows nothing of ``torch.optim`` or of modules;
:class:`gpu_worker.RemoteAdamW` and :class:`gpu_worker.streaming.LayerStreamer` sit on top of it.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from gpu_worker.bucket_exchange import BucketExchange
from gpu_worker.gradient_pushes import GradientPushes
from gpu_worker.layout import describe_bucket, gather_bucket
from gpu_worker.liveness import WorkerTimeouts
from gpu_worker.node_connections import NodeConnections, NodeError, NonFiniteGradientError, node_error
from gpu_worker.node_news import NodeNews
from gpu_worker.norm_totals import NormTotals
from gpu_worker.push_pacing import PushPacer
from gpu_worker.receive_loop import ReceiveLoop
from gpu_worker.refusals import RefusedGradients
from gpu_worker.registration import NodeRegistration, resume_account
from gpu_worker.resume import WorkerProgress, gradients_lost, resume_point
from gpu_worker.step_timings import WorkerStepTimings, elapsed
from gpu_worker.value_installer import ValueInstaller
from job.hyper import AdamWHyper
from job.placement import BucketSpec
from job.spec import JobSpec
from transport.batches import split_batch
from transport.interface import Message
from transport.security import CurveClientConfig
from transport.wire import WIRE_DTYPES, Header, MsgType, WireError

log = logging.getLogger(__name__)

BYE_WAIT_S = 5.0
"""How long closing waits for the nodes to acknowledge BYE (a node that is gone costs this once)."""

TAKE_WAITING_ROUNDS = 16
"""A forward's wait for values (``overlap_forward``) also takes up to this many more messages per node
that are already here, without waiting."""

__all__ = ["NodeError", "NonFiniteGradientError", "OffloadSession"]


class OffloadSession:
    """One worker rank's view of the job's optimizer nodes."""

    def __init__(
        self,
        nodes: Sequence[str],
        job: JobSpec,
        rank: int,
        params: Sequence[torch.Tensor],
        *,
        timeouts: WorkerTimeouts,
        curve: CurveClientConfig | None = None,
        same_host: bool = True,
        connections_per_node: int = 1,
    ) -> None:
        job.validate()
        if len(nodes) != job.num_nodes:
            raise ValueError(f"the job has {job.num_nodes} nodes but {len(nodes)} addresses were given")
        if not 0 <= rank < job.world_size:
            raise ValueError(f"rank {rank} is not in [0, {job.world_size})")
        self.nodes = list(nodes)
        self.job = job
        self.rank = rank
        self.params = list(params)
        timeouts.validate()
        self.timeouts = timeouts
        self.timeout_s = timeouts.timeout_s
        self._requests: dict[int, int] = {}  # bucket -> step asked for with PULL, not arrived yet
        self._waiting: set[int] = set()  # full mode: buckets whose new values the step waits for
        self._step_grads: tuple[Sequence[torch.Tensor | None], Sequence[AdamWHyper]] | None = None  # full mode: to push again
        self.awaiting_values = False  # full mode: between begin_step and the end of complete_step
        self._first_awaited = 0  # no bucket below it is awaited (await_values moves it up, a reconnect down)
        self._norm_totals = NormTotals()  # rank 0: the nodes' shares of a clipped step's norm, and the total sent
        # Nodes this process reconnected to: a bucket's values may come twice from them (asked for again
        # and broadcast), the second copy even after the step that awaited them ended.
        self._reconnected: set[int] = set()
        self.buckets: list[BucketSpec] = job.plan()
        self.bucket_steps = [0] * len(self.buckets)
        self.news = NodeNews()  # what the nodes told this worker: a leave request, the last norm, skipped steps
        self._wire_dtype = WIRE_DTYPES[job.wire_dtype]
        self._cuda = any(p.device.type == "cuda" for p in self.params) and torch.cuda.is_available()
        # received values into the parameters (on a GPU on a side stream, staged through buffers of the largest bucket)
        self._installer = ValueInstaller(cuda=self._cuda, staging_numel=max([job.bucket_numel, *(b.numel for b in self.buckets)]))
        self.timings = WorkerStepTimings()
        self.on_params: Callable[[int, Message], None] | None = None  # layer-wise: called for each PARAMS
        # Flow control (gpu_worker.push_pacing): gradient bytes pushed and not yet acknowledged; a push
        # that would exceed the window first waits. Layer-wise, a node's CONSUMED acknowledges a push;
        # paced full-model pushes, the bucket's new values do.
        self.pacer: PushPacer | None = None
        self.pacer_ack = MsgType.CONSUMED
        # This process, to the nodes: a restarted worker is a new incarnation of its rank, which redoes
        # the step its predecessor left unfinished and pushes only what the nodes do not have yet.
        self.incarnation = secrets.randbits(63) | 1
        self.resume_step = 0  # the step this worker (re)does first, set at HELLO
        self._connections = NodeConnections(
            self.nodes,
            rank,
            self.incarnation,
            job.to_wire(),
            timeouts,
            curve=curve,
            same_host=same_host,
            connections_per_node=connections_per_node,
        )
        # what this rank pushed of the step in progress (and what the nodes hold already after a restart), and the pushes
        self.pushes = GradientPushes(self, self._connections, self._wire_dtype, pin_memory=self._cuda)
        self._advanced_at: dict[int, int] = {}  # layer-wise: bucket -> the step this process last pushed it for
        # Non-finite gradients (--non-finite on the nodes). Refused: this rank's gradient of a bucket of
        # the open step was refused (bucket -> (node, bucket, step, values)); blocked: bucket -> (step, the
        # ranks whose gradient of it for that step was refused): it cannot come back until they push it again.
        self._refusals = RefusedGradients()
        self._exchange = BucketExchange(self._connections)
        self._registration = NodeRegistration(self._connections, self.nodes, self.pushes.batching_nodes)
        self._receiver = ReceiveLoop(self._connections, timeouts, dispatch=self._dispatch, reconnect=self._reconnect, diagnose=self._diagnose_timeout)

    # ---------------------------------------------------------------- setup

    @property
    def step(self) -> int:
        """The step the nodes are at for this worker: every bucket has had this many updates."""
        return min(self.bucket_steps, default=0)

    def connect(self) -> None:
        """Full mode: register (rank 0) or check (other ranks) the layout, then pull the current parameters."""
        self._initialize(self.hello())
        self._pull(range(len(self.buckets)), self.resume_step, "")
        log.info("rank %d connected to %d node(s); the job is at step %d", self.rank, len(self.nodes), self.step)

    def extend(self, job: JobSpec, params: Sequence[torch.Tensor]) -> list[int]:
        """A param group was added between steps: ``job`` is the old one with its parameters appended
        (``params``: every layout parameter, the new ones last). Registers it with every node (rank 0
        first, with the new buckets' values; the others wait for it), then pulls the new buckets, so
        every rank starts them from rank 0's values. Returns the new bucket ids."""
        if self.pushes.pushed or self._refusals.step_open:
            raise RuntimeError("a param group can only be added between steps (after step(), before the next backward)")
        if not self.job.extended_by(job):
            raise ValueError("the added param group must only add parameters after the existing ones")
        step = self.step
        before = (self.job, self.params, self.buckets, self.bucket_steps)
        old = len(self.buckets)
        self.job, self.params = job, list(params)
        self.buckets = job.plan()
        self.bucket_steps = self.bucket_steps + [step] * (len(self.buckets) - old)
        self.pushes.sender.set_bucket_count(len(self.buckets))
        self._connections.set_job(job.to_wire())
        try:
            needs_init = self.hello()
        except BaseException:  # a node refused the extension (it cannot fit it, a step is in flight): this worker keeps the old job
            self.job, self.params, self.buckets, self.bucket_steps = before
            self._connections.set_job(self.job.to_wire())
            raise
        added = list(range(old, len(self.buckets)))
        self._initialize(needs_init)
        self._pull(added, step, " of the added param group")
        return added

    def _initialize(self, needs_init: Sequence[int]) -> None:
        """Rank 0: give the buckets in ``needs_init`` their initial values, gathered from the parameters."""
        if self.rank != 0 or not needs_init:
            return
        log.info("registering initial values of %d buckets", len(needs_init))
        initial = torch.empty(max(self.buckets[b].numel for b in needs_init), dtype=torch.float32)
        for bucket_id in needs_init:
            values = initial[: self.buckets[bucket_id].numel]
            gather_bucket(self.buckets[bucket_id], self.params, values)
            self.send_initial(bucket_id, values)

    def _pull(self, bucket_ids: Iterable[int], at_step: int, which: str) -> None:
        """Ask for the values of ``bucket_ids`` at ``at_step`` and install them as they come (``which``
        says what they are in the timeout's message)."""
        waiting = set(bucket_ids)
        for bucket_id in sorted(waiting):
            self.request(bucket_id, at_step)
        self.on_params = lambda index, message: self._install(index, message, waiting, expect_next_step=False)
        try:
            self.receive_until(lambda: not waiting, lambda: f"no values for {len(waiting)} bucket(s){which}")
        finally:
            self.on_params = None
        self._installer.settle()

    def hello(self) -> list[int]:
        """Register (rank 0) or check (other ranks) the layout with every node; returns the buckets
        that still need initial values (only rank 0 sends them, with :meth:`send_initial`)."""
        registered = self._registration.hello(self.buckets, self.timeouts.first_answer_s)
        self._resume_at(registered.resume)
        return registered.needs_init

    def _resume_at(self, resume: dict[int, tuple[int, list[int]]]) -> None:
        """Take the step this rank (re)does from the nodes' accounts: the lowest of them. A node already
        a step further has this rank's whole gradient of that step; on the others, the buckets listed
        have it too. Only the rest is pushed."""
        step, contributed = resume_point(resume, [b.node for b in self.buckets], self.rank)
        self.resume_step = step
        self.bucket_steps = [step] * len(self.buckets)
        self.pushes.contributed = set(contributed)  # each leaves once its step is pushed again
        if contributed:
            log.warning(
                "rank %d resumes in the middle of step %d: the nodes already hold its gradient of %d of %d buckets (from the process it replaces); it pushes the other %d",
                self.rank,
                step,
                len(contributed),
                len(self.buckets),
                len(self.buckets) - len(contributed),
            )

    @property
    def shared_memory_bytes(self) -> dict[str, int]:
        """Payload bytes that went through same-host shared windows, ``sent`` and ``received``, and
        ``sent_in_place``: of those sent, the gradients gathered straight into a window."""
        return self._connections.shared_memory_bytes() | {"sent_in_place": self.pushes.sender.in_place_bytes}

    @property
    def connection_addresses(self) -> list[str]:
        """Where each node connection goes: the address given, or the node's same-host socket."""
        return self._connections.addresses

    def join_at(self, at_step: int) -> None:
        """Before :meth:`connect`: this worker joins a running job whose workers agreed to grow at ``at_step``."""
        self._connections.set_job(self.job.to_wire(), morph_at=at_step)

    def morph(self, rank: int, world_size: int, at_step: int) -> None:
        """Between steps: go on as ``rank`` of ``world_size`` workers from step ``at_step``, the step the
        job's workers agreed to change its width at (:mod:`gpu_worker.elastic`). Every node takes the new
        width once it reaches that step (:mod:`optimizer_node.morphing`); the parameters stay as they are."""
        if self.job.mode != "full":
            raise ValueError("a layer-wise job cannot change its width: morphing is for full-model jobs")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if self.pushes.pushed or self._refusals.step_open:
            raise RuntimeError(f"rank {self.rank} has pushed gradients of step {self.step}: a worker morphs between steps")
        if self.step != at_step:
            raise RuntimeError(f"rank {self.rank} is at step {self.step}, the morph is at step {at_step}: the agreement and this worker disagree")
        self.job = dataclasses.replace(self.job, world_size=world_size)
        self.rank = rank
        self._connections.set_job(self.job.to_wire(), rank=rank, morph_at=at_step)
        self._norm_totals.forget()
        self._resume_at(self._registration.hello(self.buckets, self.timeout_s).resume)
        if self.resume_step != at_step:
            raise RuntimeError(f"the nodes resumed rank {rank} at step {self.resume_step} after the morph at step {at_step}")
        log.info("rank %d of %d from step %d (the job changed its width)", rank, world_size, at_step)

    def send_initial(self, bucket_id: int, values: torch.Tensor) -> None:
        """Rank 0: give a bucket its initial fp32 values (flat); waits for the ACK."""
        self._exchange.send_initial(self.buckets[bucket_id], self.rank, values)

    def read_state(self, bucket_id: int, part: str) -> tuple[torch.Tensor, list[float]]:
        """One part of a bucket's optimizer state and its segments' step counts (see :class:`BucketExchange`)."""
        return self._exchange.read_state(self.buckets[bucket_id], self.rank, part)

    def load_state(self, bucket_id: int, part: str, values: torch.Tensor, segment_steps: list[float] | None = None) -> None:
        """Rank 0: replace one part of a bucket's optimizer state (see :class:`BucketExchange`)."""
        self._exchange.load_state(self.buckets[bucket_id], self.rank, self.bucket_steps[bucket_id], part, values, segment_steps)

    def request(self, bucket_id: int, at_step: int) -> None:
        """Layer-wise: ask for a bucket's values of ``at_step``; the node answers once the bucket is there."""
        bucket = self.buckets[bucket_id]
        self._requests[bucket_id] = at_step
        self._connections.send(bucket.node, Header(msg_type=MsgType.PULL, rank=self.rank, bucket_id=bucket_id, meta={"at_step": at_step}))

    # ---------------------------------------------------------------- one step

    def push_bucket(self, bucket_id: int, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> None:
        """Send one bucket's gradient for the current step now (``grads[i]`` belongs to ``params[i]``).

        ``hypers[g]`` are the hyperparameters of param group ``g`` for this step. Buckets not pushed
        before :meth:`finish_step` are pushed there.
        """
        self.pushes.push_bucket(bucket_id, grads, hypers)

    def stage_bucket(self, bucket_id: int, grads: Sequence[torch.Tensor | None]) -> bool:
        """A bucket's gradients are final (a hook on autograd's device thread, during backward): start
        copying them out of the device now, for :meth:`push_bucket` to send from there in ``step()``.
        Buckets that go in a batch with their neighbours, or that hold a parameter without a gradient,
        are gathered in ``step()`` as before. True where the bucket was staged."""
        return self.pushes.stage_bucket(bucket_id, grads)

    def staged_landed(self, bucket_id: int) -> bool:
        """Whether the bucket's staged copy out of the device is done (True if none is staged)."""
        return self.pushes.sender.staged_landed(bucket_id)

    def wait_staged(self, bucket_id: int) -> None:
        """Block until the bucket's staged copy out of the device landed (nothing if none is staged)."""
        self.pushes.sender.wait_staged(bucket_id)

    def push_staged(self, bucket_id: int, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> None:
        """Push a staged bucket now, unless it went already (the courier thread, during backward)."""
        self.pushes.push_staged(bucket_id, grads, hypers)

    def wait_for_room(self, pacer: PushPacer, nbytes: int, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> None:
        """Wait until ``nbytes`` more fit the push window. Values that come while nothing awaits them
        (a full-model worker pushing during backward) are kept for ``finish_step``; a node that restarts
        meanwhile gets this step's full-model pushes again from ``grads`` (final for every bucket pushed
        so far)."""
        if pacer.has_room(nbytes) or (self.pacer_ack == MsgType.PARAMS and self.on_params is not None):
            return  # full model, the step already collecting its values (a push again after a reconnect): no wait inside it
        pacer.waits += 1
        keeping = self.on_params is None
        if keeping:
            self.on_params = pacer.keep
        holding = self._step_grads is None and self.job.mode != "layerwise"
        if holding:
            self._step_grads = (grads, hypers)
        awaited = "the nodes have not consumed" if self.pacer_ack == MsgType.CONSUMED else "no new values yet for"
        try:
            self.receive_until(lambda: pacer.has_room(nbytes), lambda: f"{awaited} {pacer.in_flight_bytes} bytes of pushed gradients (the push window)")
        finally:
            if keeping:
                self.on_params = None
            if holding:
                self._step_grads = None

    def release_send_buffers(self) -> None:
        """Drop the pooled send buffers (layer-wise workers keep no gradient memory between steps)."""
        self.pushes.sender.release()

    def advance(self, bucket_ids: Sequence[int]) -> None:
        """Layer-wise: the pushed buckets' step is over for this worker (their values come on request)."""
        for bucket_id in bucket_ids:
            self._advanced_at[bucket_id] = self.bucket_steps[bucket_id]
            self.bucket_steps[bucket_id] += 1
        for bucket_id in bucket_ids:
            self.pushes.pushed.pop(bucket_id, None)
        self.pushes.skipped.difference_update(bucket_ids)

    def finish_step(self, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> None:
        """Push every bucket not pushed yet, then install each bucket's new values as it comes back
        (:meth:`begin_step`, then :meth:`complete_step`).

        When the nodes refuse this rank's gradient of some buckets (NaN/inf, ``--non-finite refuse``),
        it raises :class:`NonFiniteGradientError` once every other bucket is back or blocked, and the
        step stays open: the next call pushes the refused buckets again, from the gradients it is
        given, and waits for the rest."""
        self.begin_step(grads, hypers)
        self.complete_step()

    def begin_step(self, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> None:
        """Full mode: push every bucket not pushed yet; the new values are then awaited
        (:attr:`awaiting_values`) until :meth:`complete_step`, in part by :meth:`await_values`."""
        if self._refusals.step_open:  # a retry: the refused buckets go again
            self._refusals.retry(self.rank)
        else:
            self._waiting = set(range(len(self.buckets)))
            self._refusals.new_step()
        self._first_awaited = 0
        self._step_grads = (grads, hypers)  # a node that restarts mid-step gets them again
        self.pushes.push_remaining(grads, hypers)
        for bucket_id in sorted(self.pushes.skipped):  # their new values went to the process this one replaces
            self.request(bucket_id, self.bucket_steps[bucket_id] + 1)
        self.pushes.skipped.clear()
        waiting = self._waiting
        self.on_params = lambda index, message: self._install(index, message, waiting, expect_next_step=True)
        self._refusals.collecting = True
        self.awaiting_values = True
        try:
            if self.pacer is not None:
                self.pacer.replay(self.on_params)
        except BaseException:
            self._end_step()
            raise

    def await_values(self, upto: int) -> None:
        """The open step: install values as they come until every bucket up to ``upto`` is in (what a
        forward about to run needs). A refusal of this rank's gradient ends it as :meth:`complete_step`
        does; so does any error (the step is over, as a failed :meth:`finish_step` leaves it)."""
        waiting = self._waiting
        if self._first_awaited > upto and not self._refusals.refused:  # what this forward needs is in already
            return

        def done() -> bool:
            first = self._first_awaited  # buckets come back lowest first: a pointer, not a scan
            while first <= upto and first not in waiting:
                first += 1
            self._first_awaited = first
            return first > upto or bool(self._refusals.refused)

        try:
            self.receive_until(done, lambda: f"no parameters for bucket(s) {sorted(b for b in waiting if b <= upto)[:8]} (of {len(waiting)} missing)")
            # And what else is here already: installed early (their copies start sooner), and values
            # from a remote node do not pile up in the socket's queue while the forward computes.
            self._receiver.take_waiting(TAKE_WAITING_ROUNDS)
        except BaseException:
            self._end_step()
            raise
        if self._refusals.refused:
            self.complete_step()  # raises once the rest is back or blocked

    def complete_step(self) -> None:
        """Install every remaining value of the open step (see :meth:`finish_step`) and end it."""
        waiting = self._waiting
        try:
            # Done when every bucket is back, or, after a refusal of this rank's gradient, when each one
            # still missing waits for a refused gradient (this rank's, or another's it was told about).
            self.receive_until(
                lambda: not waiting or self._refusals.only_blocked_left(waiting, self.bucket_steps),
                lambda: f"no parameters for {len(waiting)} bucket(s)",
            )
            if waiting:
                self._refusals.step_open = True
                raise NonFiniteGradientError(self.rank, self._refusals.in_order(), self.describe_bucket)
        finally:
            self._end_step()

    def _end_step(self) -> None:
        self.awaiting_values = False
        self.on_params = None
        self._refusals.collecting = False
        self._installer.settle()
        self.pushes.sender.drop_staged()  # what was staged and not sent (a retried step stages again)
        if not self._refusals.step_open:
            if self.pacer is not None:
                self.pacer.clear()
            self.pushes.pushed.clear()
            self._step_grads = None
            self._waiting = set()
            self._refusals.clear()

    def has_reconnected(self, node_index: int) -> bool:
        """Whether this worker reconnected to node ``node_index`` (values asked for again may come twice)."""
        return node_index in self._reconnected

    def has_pushed(self, bucket_id: int) -> bool:
        """Whether the nodes hold (or are being sent) this rank's gradient of the bucket for the step in progress."""
        return bucket_id in self.pushes.pushed

    def describe_bucket(self, bucket_id: int) -> str:
        """The parameters a bucket holds, for messages (``w[0:128], b``)."""
        return describe_bucket(self.job.params, self.buckets[bucket_id])

    @property
    def send_buffers_allocated(self) -> int:
        """Push buffers made so far (after warm-up, a step should make none)."""
        return self.pushes.sender.buffers_allocated

    def take_timings(self) -> WorkerStepTimings:
        """The phases' times since the last call (a step's, when called once a step), starting anew."""
        taken, self.timings = self.timings, WorkerStepTimings()
        return taken

    @property
    def pushed(self) -> frozenset[int]:
        """Buckets already pushed for the step in progress."""
        return frozenset(self.pushes.pushed)

    def receive_until(self, done: Callable[[], bool], missing: Callable[[], str]) -> None:
        """Handle what the nodes send until ``done()``; ``TimeoutError`` (with ``missing()`` and each
        node's account of what it waits for) when nothing moves for ``timeout_s``.

        PARAMS go to ``on_params``; NOTICEs are logged; rank 0 answers the nodes' norm partials of a
        clipped step here, whatever it was waiting for; an ERROR raises :class:`NodeError`. Silent
        nodes are pinged, and one gone silent is reconnected to (see :mod:`gpu_worker.liveness`)."""
        self._receiver.run_until(done, missing, self.timings)

    def _dispatch(self, index: int, message: Message) -> None:
        header = message.header
        if header.msg_type == MsgType.ERROR:
            error = node_error(self.nodes[index], header)
            if isinstance(error, NonFiniteGradientError):
                if self._refusal_collected(error):
                    return
                error = NonFiniteGradientError(self.rank, error.refusals, self.describe_bucket, retry=False)
            raise error
        if header.msg_type == MsgType.NOTICE:
            if self.news.on_notice(self.nodes[index], header, self.rank):
                return
            self._connections.log_notice(index, header)
            refused = header.meta.get("non_finite")
            if isinstance(refused, dict) and all(isinstance(refused.get(key), int) for key in ("bucket", "step", "rank")):
                self._refusals.note_blocked(refused["bucket"], refused["step"], refused["rank"])
            return
        if header.msg_type == MsgType.CONSUMED:
            if self.pacer is not None and self.pacer_ack == MsgType.CONSUMED:
                self.pacer.returned(header.bucket_id)
            return
        if header.msg_type == MsgType.NORM_PARTIAL:
            self._norm_totals.on_share(index, header, sorted({b.node for b in self.buckets}), self._connections.send, self.rank)
            return
        if header.msg_type != MsgType.PARAMS or self.on_params is None:
            raise RuntimeError(f"unexpected {header.msg_type.name} from node {self.nodes[index]}")
        if "batch" in header.meta:
            if index not in self.pushes.batching_nodes:
                raise RuntimeError(f"node {self.nodes[index]} sent a batch of buckets, which this worker did not ask it for")
            try:
                parts = split_batch(message)
            except WireError as exc:
                raise RuntimeError(f"node {self.nodes[index]} sent a malformed batch: {exc.message}") from None
            for part in parts:
                self._on_params(index, part)
            return
        self._on_params(index, message)

    def _on_params(self, index: int, message: Message) -> None:
        header = message.header
        self.news.on_params(index, header, self.rank)
        if self._requests.get(header.bucket_id) == header.step:
            del self._requests[header.bucket_id]
        if self.pacer is not None and self.pacer_ack == MsgType.PARAMS:
            self.pacer.returned(header.bucket_id)
        self.on_params(index, message)

    def _refusal_collected(self, error: NonFiniteGradientError) -> bool:
        """finish_step: note that a node refused this rank's gradient of a bucket it waits for (the
        step raises once the rest is in); False where it must raise now (layer-wise, another rank's)."""
        node, bucket_id, step, _values = error.refusals[0]
        if not self._refusals.collecting or error.rank != self.rank or bucket_id not in self._waiting or step != self.bucket_steps[bucket_id]:
            return False
        self._refusals.record(bucket_id, error.refusals[0], self.rank)
        self.pushes.pushed.pop(bucket_id, None)  # the node does not hold it: the retry pushes it again
        log.warning("rank %d: node %s refused this rank's gradient of bucket %d at step %d (NaN/inf)", self.rank, node, bucket_id, step)
        return True

    # ---------------------------------------------------------------- a node that went away

    def _reconnect(self, index: int, why: str | None = None) -> None:
        """Reach node ``index`` again at the address it was given (its same-host socket may be gone
        with it) and continue where it is: push again what it lost, ask again for what is awaited."""
        address = self.nodes[index]
        silent = self._connections.liveness.silent_for(index)
        why = why or f"it has not answered for {silent:.0f} s"
        log.warning("rank %d: node %s: %s; reconnecting (for up to %.0f s)", self.rank, address, why, self.timeouts.reconnect_s)
        self.pushes.sender.forget(index)
        try:
            reply = self._registration.reconnect(index, self.timeouts.reconnect_s, self.buckets)
        except TimeoutError:
            raise ConnectionError(
                f"rank {self.rank}, step {self.step}: node {address} stopped answering ({why}) and did not come back within "
                f"{self.timeouts.reconnect_s:.0f} s: restart it with the same flags plus --resume (the workers reconnect by themselves), or check the network"
            ) from None
        self._resync(index, reply)

    def _resync(self, index: int, reply: Message) -> None:
        self._reconnected.add(index)
        meta = reply.header.meta
        address = self.nodes[index]
        mine = [b.bucket_id for b in self.buckets if b.node == index]
        node_step, held = resume_account(reply)
        contributed = set(held)
        progress = WorkerProgress(
            self.rank,
            self.job.mode == "layerwise",
            mine,
            self.bucket_steps,
            self.news.seen_step(index),
            self._advanced_at,
            self.pushes.pushed,
            keeps_gradients=self._step_grads is not None,
        )
        step, lost = gradients_lost(address, node_step, contributed, bool(meta.get("needs_init")), progress)
        log.warning("rank %d: node %s is back at step %d; pushing %d bucket(s) again", self.rank, address, node_step, len(lost))
        for bucket_id in lost:
            if self.bucket_steps[bucket_id] > step:  # installed from the node's previous life: it comes again
                self.bucket_steps[bucket_id] = step
                self._waiting.add(bucket_id)
                self._first_awaited = min(self._first_awaited, bucket_id)
        # Ask first: a request that reaches the node before the push that completes the bucket is
        # answered once, at the update, instead of the update's broadcast.
        asked = dict(self._requests)  # what the node's previous life was asked for
        asked.update({b: self.bucket_steps[b] + 1 for b in self._waiting})
        if self.job.mode != "layerwise":
            # Pushed this step (a paced worker reconnects in the middle of backward, before the step
            # awaits anything) and not back: the node may have sent the new values to the connection
            # this one replaced, where they are lost. Asked for, they come once more; a copy that came
            # twice is known by its step (see _install).
            asked.update({b: at + 1 for b, at in self.pushes.pushed.items() if at == self.bucket_steps[b]})
        for bucket_id, at_step in sorted(asked.items()):
            if self.buckets[bucket_id].node == index:
                self.request(bucket_id, at_step)
        if lost:
            grads, hypers = self._step_grads  # type: ignore[misc]
            for bucket_id in lost:
                self.pushes.pushed.pop(bucket_id, None)
                self.push_bucket(bucket_id, grads, hypers)

    def _install(self, node_index: int, message: Message, waiting: set[int], expect_next_step: bool) -> None:
        header = message.header
        bucket_id = header.bucket_id
        if (
            node_index in self._reconnected
            and 0 <= bucket_id < len(self.buckets)
            and header.step == self.bucket_steps[bucket_id]
            and (expect_next_step or bucket_id not in waiting)
        ):
            return  # after a reconnect, values already installed can come twice (asked for again and broadcast)
        if bucket_id not in waiting or self.buckets[bucket_id].node != node_index:
            raise RuntimeError(f"node {self.nodes[node_index]} sent bucket {bucket_id}, which this worker did not ask it for")
        bucket = self.buckets[bucket_id]
        unchanged = header.meta.get("unchanged") is True and header.numel == 0  # no rank had a gradient for it: the values stay
        if not unchanged and (header.numel != bucket.numel or header.dtype != self.job.wire_dtype):
            raise RuntimeError(
                f"node {self.nodes[node_index]} sent bucket {bucket_id} as {header.numel} x {header.dtype}, expected {bucket.numel} x {self.job.wire_dtype}"
            )
        expected = self.bucket_steps[bucket_id] + (1 if expect_next_step else 0)
        if header.step != expected:
            raise RuntimeError(f"node {self.nodes[node_index]} sent bucket {bucket_id} of step {header.step}, expected step {expected}")
        if not unchanged:
            started = time.perf_counter()
            self._installer.install(bucket, message, self.params, node=self.nodes[node_index])
            self.timings.install_s += elapsed(started)
            self.timings.installs += 1
        self.bucket_steps[bucket_id] = header.step
        waiting.discard(bucket_id)

    # ---------------------------------------------------------------- errors

    def _diagnose_timeout(self, missing: str) -> str:
        """The timeout's message: what this worker misses and, per node, what the node waits for."""
        refused = self._refusals.accounts(since_step=self.step - 1)  # layer-wise: pushed buckets are counted a step ahead
        return "; ".join([f"rank {self.rank}, step {self.step}: {missing} after {self.timeout_s:.0f} s", *refused, *self._connections.accounts()])

    def close(self) -> None:
        """Tell every node this rank is done (once every rank has, between steps, a node knows its job
        is finished and can take the next), then close the connections."""
        self._registration.say_bye(min(self.timeout_s, BYE_WAIT_S))
        self._connections.close()
