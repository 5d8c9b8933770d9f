"""A worker's connections to the optimizer nodes of its job.

:class:`OffloadSession` registers the layout, pushes gradient buckets and installs the values the
nodes send back. In full mode (:meth:`connect` + :meth:`finish_step`, or its two halves) every bucket
comes back after every step; in layer-wise mode the caller asks for buckets when it needs them (:meth:`request`) and
handles their arrival itself (the PARAMS route). It knows nothing of ``torch.optim`` or of modules;
:class:`gpu_worker.RemoteAdamW` and :class:`gpu_worker.layerwise.streaming.LayerStreamer` sit on top of it.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Callable, Sequence

import torch

from gpu_worker.exchange.awaited_values import AwaitedValues
from gpu_worker.exchange.gradient_pushes import GradientPushes
from gpu_worker.exchange.push_pacing import PushPacer
from gpu_worker.exchange.value_installer import ValueInstaller
from gpu_worker.layerwise.streaming import StreamLinks
from gpu_worker.layout import gather_bucket
from gpu_worker.links.bucket_exchange import BucketExchange
from gpu_worker.links.connections import NodeConnections, NodeError, NonFiniteGradientError
from gpu_worker.links.liveness import WorkerTimeouts
from gpu_worker.links.messages import NodeMessages, ParamsRoute
from gpu_worker.links.news import NodeNews
from gpu_worker.links.rank_state import RankState
from gpu_worker.links.receive_loop import ReceiveLoop
from gpu_worker.links.recovery import NodeRecovery
from gpu_worker.links.refusals import RefusedGradients
from gpu_worker.links.registration import NodeRegistration
from gpu_worker.links.resume import resume_point
from gpu_worker.links.step_timings import WorkerStepTimings
from protos.job.hyper import AdamWHyper
from protos.job.placement import BucketSpec
from protos.job.spec import JobSpec
from transport.wire import WIRE_DTYPES, MsgType
from transport.zeromq.security import CurveClientConfig

log = logging.getLogger(__name__)

BYE_WAIT_S = 5.0
"""How long closing waits for the nodes to acknowledge BYE (a node that is gone costs this once)."""

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
        keep_step_gradients: bool = True,
        pacer: PushPacer | None = None,
        pacer_ack: MsgType = MsgType.CONSUMED,
    ) -> None:
        job.validate()
        if len(nodes) != job.num_nodes:
            raise ValueError(f"the job has {job.num_nodes} nodes but {len(nodes)} addresses were given")
        if not 0 <= rank < job.world_size:
            raise ValueError(f"rank {rank} is not in [0, {job.world_size})")
        timeouts.validate()
        self.timeouts = timeouts
        self.timeout_s = timeouts.timeout_s
        # what this rank knows of its job (rank, buckets, their steps, ...), shared with the parts below
        self.state = RankState(nodes, job, rank, params)
        self.news = NodeNews()  # what the nodes told this worker: a leave request, the last norm, skipped steps
        self._wire_dtype = WIRE_DTYPES[job.wire_dtype]
        self._cuda = any(p.device.type == "cuda" for p in self.state.params) and torch.cuda.is_available()
        # received values into the parameters (on a GPU on a side stream, staged through buffers of the largest bucket)
        buckets = self.state.buckets
        self._installer = ValueInstaller(cuda=self._cuda, staging_numel=max([job.bucket_numel, *(b.numel for b in buckets)]))
        # Flow control (gpu_worker.exchange.push_pacing): gradient bytes pushed and not yet acknowledged; a push
        # that would exceed the window first waits. Layer-wise, a node's CONSUMED acknowledges a push;
        # paced full-model pushes, the bucket's new values do.
        self.pacer = pacer
        self.pacer_ack = pacer_ack
        self._route = ParamsRoute()  # where PARAMS go: what awaits values at the moment
        # This process, to the nodes: a restarted worker is a new incarnation of its rank, which redoes
        # the step its predecessor left unfinished and pushes only what the nodes do not have yet.
        self.incarnation = secrets.randbits(63) | 1
        self._connections = NodeConnections(
            self.state.nodes,
            rank,
            self.incarnation,
            job.to_wire(),
            timeouts,
            curve=curve,
            same_host=same_host,
            connections_per_node=connections_per_node,
        )
        # what this rank pushed of the step in progress (and what the nodes hold already after a restart), and the pushes
        self.pushes = GradientPushes(
            self.state, self._connections, self._wire_dtype, pin_memory=self._cuda, pacer=pacer, pacer_ack=pacer_ack, wait_for_room=self.wait_for_room
        )
        self._advanced_at: dict[int, int] = {}  # layer-wise: bucket -> the step this process last pushed it for
        # Non-finite gradients (--non-finite on the nodes). Refused: this rank's gradient of a bucket of
        # the open step was refused (bucket -> (node, bucket, step, values)); blocked: bucket -> (step, the
        # ranks whose gradient of it for that step was refused): it cannot come back until they push it again.
        self._refusals = RefusedGradients()
        self._exchange = BucketExchange(self._connections)
        self._registration = NodeRegistration(self._connections, self.state.nodes, self.pushes.batching_nodes)
        # full mode: the values pulled at connect and awaited after each step's pushes, installed as they come.
        # The PULLs, the receive loop and the reconnects come after it: it reaches them through this
        # session's methods, bound here and called only once everything is built.
        self._values = AwaitedValues(
            self.state,
            self.pushes,
            self._refusals,
            self._installer,
            route=self._route,
            pacer=pacer,
            request=self.request,
            receive_until=self.receive_until,
            has_reconnected=self.has_reconnected,
            keep_gradients=keep_step_gradients,
        )
        # each message from the nodes to its place; the PULLs not answered yet; rank 0's norm totals
        self._messages = NodeMessages(
            self.state,
            self._connections,
            self.news,
            self._refusals,
            self.pushes.batching_nodes,
            route=self._route,
            pacer=pacer,
            pacer_ack=pacer_ack,
            timeout_s=self.timeout_s,
            collect_refusal=self._values.collect_refusal,
        )
        # a node that went away: reconnected to, and brought up to date with this rank
        self._recovery = NodeRecovery(
            self.state,
            self._connections,
            self._registration,
            timeouts,
            pushes=self.pushes,
            values=self._values,
            messages=self._messages,
            news=self.news,
            advanced_at=self._advanced_at,
        )
        self._receiver = ReceiveLoop(
            self._connections, timeouts, dispatch=self._messages.dispatch, reconnect=self._recovery.reconnect, diagnose=self._messages.diagnose_timeout
        )

    # ---------------------------------------------------------------- this rank's place in the job

    @property
    def nodes(self) -> list[str]:
        """The nodes' addresses, as given."""
        return self.state.nodes

    @property
    def job(self) -> JobSpec:
        """The job's spec (it changes when a param group is added or the job morphs)."""
        return self.state.job

    @property
    def rank(self) -> int:
        """This worker's rank (it changes when the job morphs)."""
        return self.state.rank

    @property
    def params(self) -> list[torch.Tensor]:
        """The job's parameters in layout order."""
        return self.state.params

    @property
    def buckets(self) -> list[BucketSpec]:
        """The job's buckets."""
        return self.state.buckets

    @property
    def bucket_steps(self) -> list[int]:
        """Each bucket's step as this worker knows it."""
        return self.state.bucket_steps

    @property
    def resume_step(self) -> int:
        """The step this worker (re)does first, set at HELLO."""
        return self.state.resume_step

    @property
    def timings(self) -> WorkerStepTimings:
        """The phases' times since :meth:`take_timings`."""
        return self.state.timings

    def stream_links(self) -> StreamLinks:
        """What a layer-wise streamer uses of this session: its state, the PARAMS route and the calls
        that register, fetch, push and end a step (bound methods: the streamer holds no session)."""
        return StreamLinks(
            state=self.state,
            route=self._route,
            hello=self.hello,
            send_initial=self.send_initial,
            request=self.request,
            receive_until=self.receive_until,
            has_reconnected=self.has_reconnected,
            stage=self.stage_bucket,
            push=self.push_bucket,
            landed=self.staged_landed,
            advance=self.advance,
            release_send_buffers=self.release_send_buffers,
        )

    # ---------------------------------------------------------------- setup

    @property
    def step(self) -> int:
        """The step the nodes are at for this worker: every bucket has had this many updates."""
        return self.state.step

    def connect(self) -> None:
        """Full mode: register (rank 0) or check (other ranks) the layout, then pull the current parameters."""
        self._initialize(self.hello())
        self._values.pull(range(len(self.state.buckets)), self.state.resume_step, "")
        log.info("rank %d connected to %d node(s); the job is at step %d", self.state.rank, len(self.state.nodes), self.step)

    def extend(self, job: JobSpec, params: Sequence[torch.Tensor]) -> list[int]:
        """A param group was added between steps: ``job`` is the old one with its parameters appended
        (``params``: every layout parameter, the new ones last). Registers it with every node (rank 0
        first, with the new buckets' values; the others wait for it), then pulls the new buckets, so
        every rank starts them from rank 0's values. Returns the new bucket ids."""
        if self.pushes.pushed or self._refusals.step_open:
            raise RuntimeError("a param group can only be added between steps (after step(), before the next backward)")
        if not self.state.job.extended_by(job):
            raise ValueError("the added param group must only add parameters after the existing ones")
        step = self.step
        before = (self.state.job, self.state.params, self.state.buckets, self.state.bucket_steps)
        old = len(self.state.buckets)
        self.state.job, self.state.params = job, list(params)
        self.state.buckets = job.plan()
        self.state.bucket_steps = self.state.bucket_steps + [step] * (len(self.state.buckets) - old)
        self.pushes.sender.set_bucket_count(len(self.state.buckets))
        self._connections.set_job(job.to_wire())
        try:
            needs_init = self.hello()
        except BaseException:  # a node refused the extension (it cannot fit it, a step is in flight): this worker keeps the old job
            self.state.job, self.state.params, self.state.buckets, self.state.bucket_steps = before
            self._connections.set_job(self.state.job.to_wire())
            raise
        added = list(range(old, len(self.state.buckets)))
        self._initialize(needs_init)
        self._values.pull(added, step, " of the added param group")
        return added

    def _initialize(self, needs_init: Sequence[int]) -> None:
        """Rank 0: give the buckets in ``needs_init`` their initial values, gathered from the parameters."""
        if self.state.rank != 0 or not needs_init:
            return
        log.info("registering initial values of %d buckets", len(needs_init))
        initial = torch.empty(max(self.state.buckets[b].numel for b in needs_init), dtype=torch.float32)
        for bucket_id in needs_init:
            values = initial[: self.state.buckets[bucket_id].numel]
            gather_bucket(self.state.buckets[bucket_id], self.state.params, values)
            self.send_initial(bucket_id, values)

    def hello(self) -> list[int]:
        """Register (rank 0) or check (other ranks) the layout with every node; returns the buckets
        that still need initial values (only rank 0 sends them, with :meth:`send_initial`)."""
        registered = self._registration.hello(self.state.buckets, self.timeouts.first_answer_s)
        self._resume_at(registered.resume)
        return registered.needs_init

    def _resume_at(self, resume: dict[int, tuple[int, list[int]]]) -> None:
        """Take the step this rank (re)does from the nodes' accounts: the lowest of them. A node already
        a step further has this rank's whole gradient of that step; on the others, the buckets listed
        have it too. Only the rest is pushed."""
        step, contributed = resume_point(resume, [b.node for b in self.state.buckets], self.state.rank)
        self.state.resume_step = step
        self.state.bucket_steps = [step] * len(self.state.buckets)
        self.pushes.contributed = set(contributed)  # each leaves once its step is pushed again
        if contributed:
            log.warning(
                "rank %d resumes in the middle of step %d: the nodes already hold its gradient of %d of %d buckets (from the process it replaces); it pushes the other %d",
                self.state.rank,
                step,
                len(contributed),
                len(self.state.buckets),
                len(self.state.buckets) - len(contributed),
            )

    @property
    def shared_memory_bytes(self) -> dict[str, int]:
        """Payload bytes that went through same-host shared windows, ``sent`` and ``received``, and
        ``sent_in_place``: of those sent, the gradients gathered straight into a window."""
        return self._connections.shared_memory_bytes() | {"sent_in_place": self.pushes.sender.in_place_bytes}

    @property
    def device_copy_bytes(self) -> dict[str, int]:
        """Full mode on a GPU: value bytes copied up, ``direct`` from page-locked windows and boards,
        ``staged`` through pinned buffers."""
        return self._installer.device_copy_bytes

    @property
    def connection_addresses(self) -> list[str]:
        """Where each node connection goes: the address given, or the node's same-host socket."""
        return self._connections.addresses

    def join_at(self, at_step: int) -> None:
        """Before :meth:`connect`: this worker joins a running job whose workers agreed to grow at ``at_step``."""
        self._connections.set_job(self.state.job.to_wire(), morph_at=at_step)

    def morph(self, rank: int, world_size: int, at_step: int) -> None:
        """Between steps: go on as ``rank`` of ``world_size`` workers from step ``at_step``, the step the
        job's workers agreed to change its width at (:mod:`gpu_worker.elastic`). Every node takes the new
        width once it reaches that step (:mod:`optimizer_node.intake.morphing`); the parameters stay as they are."""
        if self.state.job.mode != "full":
            raise ValueError("a layer-wise job cannot change its width: morphing is for full-model jobs")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if self.pushes.pushed or self._refusals.step_open:
            raise RuntimeError(f"rank {self.state.rank} has pushed gradients of step {self.step}: a worker morphs between steps")
        if self.step != at_step:
            raise RuntimeError(f"rank {self.state.rank} is at step {self.step}, the morph is at step {at_step}: the agreement and this worker disagree")
        self.state.job = dataclasses.replace(self.state.job, world_size=world_size)
        self.state.rank = rank
        self._connections.set_job(self.state.job.to_wire(), rank=rank, morph_at=at_step)
        self._messages.norm_totals.forget()
        self._resume_at(self._registration.hello(self.state.buckets, self.timeout_s).resume)
        if self.state.resume_step != at_step:
            raise RuntimeError(f"the nodes resumed rank {rank} at step {self.state.resume_step} after the morph at step {at_step}")
        log.info("rank %d of %d from step %d (the job changed its width)", rank, world_size, at_step)

    def send_initial(self, bucket_id: int, values: torch.Tensor) -> None:
        """Rank 0: give a bucket its initial fp32 values (flat); waits for the ACK."""
        self._exchange.send_initial(self.state.buckets[bucket_id], self.state.rank, values)

    def read_state(self, bucket_id: int, part: str) -> tuple[torch.Tensor, list[float]]:
        """One part of a bucket's optimizer state and its segments' step counts (see :class:`BucketExchange`)."""
        return self._exchange.read_state(self.state.buckets[bucket_id], self.state.rank, part)

    def load_state(self, bucket_id: int, part: str, values: torch.Tensor, segment_steps: list[float] | None = None) -> None:
        """Rank 0: replace one part of a bucket's optimizer state (see :class:`BucketExchange`)."""
        self._exchange.load_state(self.state.buckets[bucket_id], self.state.rank, self.state.bucket_steps[bucket_id], part, values, segment_steps)

    def request(self, bucket_id: int, at_step: int) -> None:
        """Layer-wise: ask for a bucket's values of ``at_step``; the node answers once the bucket is there."""
        self._messages.request(bucket_id, at_step)

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
        if pacer.has_room(nbytes) or (self.pacer_ack == MsgType.PARAMS and self._route.handler is not None):
            return  # full model, the step already collecting its values (a push again after a reconnect): no wait inside it
        pacer.waits += 1
        keeping = self._route.handler is None
        if keeping:
            self._route.handler = pacer.keep
        awaited = "the nodes have not consumed" if self.pacer_ack == MsgType.CONSUMED else "no new values yet for"
        try:
            with self._values.held(grads, hypers):
                self.receive_until(lambda: pacer.has_room(nbytes), lambda: f"{awaited} {pacer.in_flight_bytes} bytes of pushed gradients (the push window)")
        finally:
            if keeping:
                self._route.handler = None

    def release_send_buffers(self) -> None:
        """Drop the pooled send buffers (layer-wise workers keep no gradient memory between steps)."""
        self.pushes.sender.release()

    def advance(self, bucket_ids: Sequence[int]) -> None:
        """Layer-wise: the pushed buckets' step is over for this worker (their values come on request)."""
        for bucket_id in bucket_ids:
            self._advanced_at[bucket_id] = self.state.bucket_steps[bucket_id]
            self.state.bucket_steps[bucket_id] += 1
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
        self._values.begin(grads, hypers)

    def await_values(self, upto: int) -> None:
        """The open step: install values as they come until every bucket up to ``upto`` is in (what a
        forward about to run needs). A refusal of this rank's gradient ends it as :meth:`complete_step`
        does; so does any error (the step is over, as a failed :meth:`finish_step` leaves it)."""
        self._values.await_upto(upto, self._receiver.take_waiting)

    def complete_step(self) -> None:
        """Install every remaining value of the open step (see :meth:`finish_step`) and end it."""
        self._values.complete()

    @property
    def awaiting_values(self) -> bool:
        """Full mode: between :meth:`begin_step` and the end of :meth:`complete_step`."""
        return self._values.awaiting

    def has_reconnected(self, node_index: int) -> bool:
        """Whether this worker reconnected to node ``node_index`` (values asked for again may come twice)."""
        return self._recovery.has_reconnected(node_index)

    def has_pushed(self, bucket_id: int) -> bool:
        """Whether the nodes hold (or are being sent) this rank's gradient of the bucket for the step in progress."""
        return bucket_id in self.pushes.pushed

    def describe_bucket(self, bucket_id: int) -> str:
        """The parameters a bucket holds, for messages (``w[0:128], b``)."""
        return self.state.describe_bucket(bucket_id)

    @property
    def send_buffers_allocated(self) -> int:
        """Push buffers made so far (after warm-up, a step should make none)."""
        return self.pushes.sender.buffers_allocated

    def take_timings(self) -> WorkerStepTimings:
        """The phases' times since the last call (a step's, when called once a step), starting anew."""
        taken, self.state.timings = self.state.timings, WorkerStepTimings()
        return taken

    @property
    def pushed(self) -> frozenset[int]:
        """Buckets already pushed for the step in progress."""
        return frozenset(self.pushes.pushed)

    def receive_until(self, done: Callable[[], bool], missing: Callable[[], str]) -> None:
        """Handle what the nodes send until ``done()``; ``TimeoutError`` (with ``missing()`` and each
        node's account of what it waits for) when nothing moves for ``timeout_s``.

        PARAMS go to the PARAMS route's handler; NOTICEs are logged; rank 0 answers the nodes' norm partials of a
        clipped step here, whatever it was waiting for; an ERROR raises :class:`NodeError`. Silent
        nodes are pinged, and one gone silent is reconnected to (see :mod:`gpu_worker.links.liveness`)."""
        self._receiver.run_until(done, missing, self.state.timings)

    def close(self) -> None:
        """Tell every node this rank is done (once every rank has, between steps, a node knows its job
        is finished and can take the next), then close the connections."""
        self._registration.say_bye(min(self.timeout_s, BYE_WAIT_S))
        self._connections.close()
