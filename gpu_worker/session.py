"""A worker's connections to the optimizer nodes of its job.

:class:`OffloadSession` registers the layout, pushes gradient buckets and installs the values the
nodes send back. In full mode (:meth:`connect` + :meth:`finish_step`) every bucket comes back after
every step; in layer-wise mode the caller asks for buckets when it needs them (:meth:`request`) and
handles their arrival itself (``on_params``). It knows nothing of ``torch.optim`` or of modules;
:class:`gpu_worker.RemoteAdamW` and :class:`gpu_worker.streaming.LayerStreamer` sit on top of it.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import time
from collections.abc import Callable, Sequence

import torch

from gpu_worker.diagnosis import ask_what_nodes_wait_for
from gpu_worker.layout import gather_bucket, scatter_bucket
from gpu_worker.liveness import NodeLiveness, WorkerTimeouts
from optimizer_node.adamw import AdamWHyper
from optimizer_node.job import JobSpec
from optimizer_node.placement import BucketSpec
from transport import backend_for, create_transport
from transport.interface import ClientEndpoint, Message, SendHandle
from transport.security import CurveClientConfig
from transport.wire import WIRE_DTYPES, ErrorCode, Header, MsgType, tensor_header

log = logging.getLogger(__name__)


class NodeError(RuntimeError):
    """An optimizer node rejected a request; ``code`` says why."""

    def __init__(self, node: str, code: int, message: str) -> None:
        try:
            name = ErrorCode(code).name
        except ValueError:
            name = str(code)
        super().__init__(f"optimizer node {node} rejected the request ({name}): {message}")
        self.node = node
        self.code = code


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
        self._liveness = NodeLiveness(len(self.nodes), timeouts)
        self._requests: dict[int, int] = {}  # bucket -> step asked for with PULL, not arrived yet
        self._waiting: set[int] = set()  # full mode: buckets whose new values the step waits for
        self._step_grads: tuple[Sequence[torch.Tensor | None], Sequence[AdamWHyper]] | None = None  # full mode: to push again
        self._last_clip: tuple[int, float] | None = None  # rank 0: (step, sum of squares) of the last CLIP sent
        self._reconnected = False  # a node was reconnected to in this step: a bucket's values may come twice
        self.buckets: list[BucketSpec] = job.plan()
        self.bucket_steps = [0] * len(self.buckets)
        self.last_grad_norm: float | None = None
        self._wire_dtype = WIRE_DTYPES[job.wire_dtype]
        # Send buffers are reused once the zero-copy send that read them is done; pinned when
        # gradients come from a GPU, so the device-to-host copies can be asynchronous.
        self._pin = any(p.device.type == "cuda" for p in self.params) and torch.cuda.is_available()
        self._free_buffers: dict[int, list[torch.Tensor]] = {}  # numel -> buffers no send reads
        self._sending: list[tuple[SendHandle, torch.Tensor]] = []
        self.on_params: Callable[[int, Message], None] | None = None  # layer-wise: called for each PARAMS
        # Layer-wise flow control: gradient bytes pushed and not yet consumed by their node; a push
        # that would exceed the window first waits for CONSUMED messages.
        self.push_window_bytes: int | None = None
        self._unconsumed: dict[int, int] = {}
        self._norm_partials: dict[int, float] = {}
        # This process, to the nodes: a restarted worker is a new incarnation of its rank, which redoes
        # the step its predecessor left unfinished and pushes only what the nodes do not have yet.
        self.incarnation = secrets.randbits(63) | 1
        self.resume_step = 0  # the step this worker (re)does first, set at HELLO
        self._contributed: set[int] = set()  # buckets of resume_step that already hold this rank's gradient
        self._skipped: set[int] = set()  # pushes of this step left out because the node has them
        backends = {backend_for(url) for url in self.nodes}
        if len(backends) > 1:
            raise ValueError(f"the nodes of a job use one transport; these addresses mix {sorted(backends)}: {self.nodes}")
        lanes = {"connections_per_peer": connections_per_node} if connections_per_node != 1 else {}
        self._transport = create_transport(self.nodes[0], curve_client=curve, **lanes)
        self._curve = curve
        self._clients: list[ClientEndpoint] = [self._transport.connect(url) for url in self.nodes]
        self._same_host = same_host
        self._pushed: set[int] = set()
        self._closed = False

    # ---------------------------------------------------------------- setup

    @property
    def step(self) -> int:
        """The step the nodes are at for this worker: every bucket has had this many updates."""
        return min(self.bucket_steps, default=0)

    def connect(self) -> None:
        """Full mode: register (rank 0) or check (other ranks) the layout, then pull the current parameters."""
        needs_init = self.hello()
        if needs_init and self.rank == 0:
            log.info("registering initial values of %d buckets", len(needs_init))
            initial = torch.empty(max(self.buckets[b].numel for b in needs_init), dtype=torch.float32)
            for bucket_id in needs_init:
                values = initial[: self.buckets[bucket_id].numel]
                gather_bucket(self.buckets[bucket_id], self.params, values)
                self.send_initial(bucket_id, values)
        for bucket in self.buckets:
            self.request(bucket.bucket_id, self.resume_step)
        waiting = set(range(len(self.buckets)))
        self.on_params = lambda index, message: self._install(index, message, waiting, expect_next_step=False)
        try:
            self.receive_until(lambda: not waiting, lambda: f"no parameters for {len(waiting)} bucket(s)")
        finally:
            self.on_params = None
        log.info("rank %d connected to %d node(s); the job is at step %d", self.rank, len(self.nodes), self.step)

    def hello(self) -> list[int]:
        """Register (rank 0) or check (other ranks) the layout with every node; returns the buckets
        that still need initial values (only rank 0 sends them, with :meth:`send_initial`)."""
        for index in range(len(self._clients)):
            self._send_hello(index)
        needs_init: list[int] = []
        resume: dict[int, tuple[int, list[int]]] = {}
        for index in range(len(self._clients)):
            reply = self._registered(index, self.timeouts.first_answer_s)
            needs_init += reply.header.meta.get("needs_init", [])
            resume[index] = (int(reply.header.meta["resume_step"]), [int(b) for b in reply.header.meta["contributed"]])
        self._resume_at(resume)
        return sorted(needs_init)

    def _send_hello(self, index: int) -> None:
        meta = {"job": self.job.to_wire(), "incarnation": self.incarnation, "node_index": index}
        self._clients[index].send(Header(msg_type=MsgType.HELLO, rank=self.rank, meta=meta))

    def _registered(self, index: int, first_answer_s: float) -> Message:
        """The node's HELLO_OK to the HELLO just sent (moving to its same-host socket if it has one
        here), checked against the plan. The node must answer within ``first_answer_s`` (a NOTICE
        that it waits for rank 0 counts); its HELLO_OK may then take up to ``timeout_s``."""
        hint = (
            "is this worker's public key in the node's --curve-allow directory, and curve_server_key the node's key?"
            if self._curve
            else "if the node uses CURVE, give this worker its keys."
        )
        what = f"registration (is a node running at that address and reachable from this host? {hint})"
        reply = self._expect(index, MsgType.HELLO_OK, what, first_answer_s=first_answer_s)
        same_host = reply.header.meta.get("same_host")
        if self._same_host and isinstance(same_host, str) and _reachable_here(same_host):
            reply = self._switch_to_same_host(index, same_host, what)
        owned = sorted(b.bucket_id for b in self.buckets if b.node == index)
        if reply.header.meta.get("owned") != owned:
            raise RuntimeError(f"node {self.nodes[index]} owns buckets {reply.header.meta.get('owned')}, the plan says {owned}")
        self._liveness.heard(index)
        return reply

    def _resume_at(self, resume: dict[int, tuple[int, list[int]]]) -> None:
        """Take the step this rank (re)does from the nodes' accounts: the lowest of them. A node already
        a step further has this rank's whole gradient of that step; on the others, the buckets listed
        have it too. Only the rest is pushed."""
        steps = {index: step for index, (step, _) in resume.items()}
        step = min(steps.values(), default=0)
        if max(steps.values(), default=0) > step + 1:
            raise RuntimeError(f"the nodes disagree on the step of rank {self.rank} ({steps}): were some of them resumed from older checkpoints?")
        contributed: set[int] = set()
        for index, (node_step, buckets) in resume.items():
            if node_step > step:
                contributed.update(b.bucket_id for b in self.buckets if b.node == index)
            else:
                contributed.update(buckets)
        self.resume_step = step
        self.bucket_steps = [step] * len(self.buckets)
        self._contributed = contributed
        if contributed:
            log.warning(
                "rank %d resumes in the middle of step %d: the nodes already hold its gradient of %d of %d buckets (from the process it replaces); it pushes the other %d",
                self.rank,
                step,
                len(contributed),
                len(self.buckets),
                len(self.buckets) - len(contributed),
            )

    def _switch_to_same_host(self, index: int, address: str, what: str) -> Message:
        """The node is on this host: say HELLO again over its ipc:// socket and use that connection
        (the node then answers this rank there), closing the TCP one. If the socket does not answer
        within 10 s, stay on TCP: say HELLO there again, so the node answers this rank there."""
        tcp = self._clients[index]
        self._clients[index] = self._transport.connect(address)
        try:
            self._send_hello(index)
            reply = self._expect(index, MsgType.HELLO_OK, f"registration over the same-host socket {address}", first_answer_s=min(10.0, self.timeout_s))
        except TimeoutError as exc:
            self._clients[index].close()
            self._clients[index] = tcp
            log.warning("rank %d stays on %s: %s", self.rank, self.nodes[index], exc)
            self._send_hello(index)
            return self._expect(index, MsgType.HELLO_OK, what, first_answer_s=self.timeouts.first_answer_s)
        tcp.close()
        log.info("rank %d talks to node %s over %s (same host)", self.rank, self.nodes[index], address)
        return reply

    @property
    def connection_addresses(self) -> list[str]:
        """Where each node connection goes: the address given, or the node's same-host socket."""
        return [client.address for client in self._clients]

    def send_initial(self, bucket_id: int, values: torch.Tensor) -> None:
        """Rank 0: give a bucket its initial fp32 values (flat, ``numel`` of the bucket); waits for the ACK."""
        bucket = self.buckets[bucket_id]
        self._clients[bucket.node].send(tensor_header(MsgType.INIT, values, rank=self.rank, bucket_id=bucket_id), values)
        self._expect(bucket.node, MsgType.ACK, f"initial values of bucket {bucket_id}")

    def request(self, bucket_id: int, at_step: int) -> None:
        """Layer-wise: ask for a bucket's values of ``at_step``; the node answers once the bucket is there."""
        bucket = self.buckets[bucket_id]
        self._requests[bucket_id] = at_step
        self._clients[bucket.node].send(Header(msg_type=MsgType.PULL, rank=self.rank, bucket_id=bucket_id, meta={"at_step": at_step}))

    # ---------------------------------------------------------------- one step

    def push_bucket(self, bucket_id: int, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> None:
        """Send one bucket's gradient for the current step now (``grads[i]`` belongs to ``params[i]``).

        ``hypers[g]`` are the hyperparameters of param group ``g`` for this step. Buckets not pushed
        before :meth:`finish_step` are pushed there.
        """
        if bucket_id in self._pushed:
            raise RuntimeError(f"bucket {bucket_id} was already pushed for step {self.bucket_steps[bucket_id]}")
        bucket = self.buckets[bucket_id]
        if bucket_id in self._contributed and self.bucket_steps[bucket_id] == self.resume_step:
            self._contributed.discard(bucket_id)  # the node has this rank's gradient of this step already
            self._skipped.add(bucket_id)
            self._pushed.add(bucket_id)
            return
        if self.push_window_bytes is not None:
            nbytes = bucket.numel * self._wire_dtype.itemsize
            window = self.push_window_bytes
            self.receive_until(
                lambda: not self._unconsumed or sum(self._unconsumed.values()) + nbytes <= window,
                lambda: f"the nodes have not consumed {sum(self._unconsumed.values())} bytes of gradients",
            )
            self._unconsumed[bucket_id] = nbytes
        buffer = self._send_buffer(bucket.numel)
        gather_bucket(bucket, grads, buffer)
        if buffer.is_pinned():
            torch.cuda.current_stream().synchronize()  # the device-to-host copies were asynchronous
        header = tensor_header(
            MsgType.PUSH,
            buffer,
            rank=self.rank,
            step=self.bucket_steps[bucket_id],
            bucket_id=bucket_id,
            meta={"hyper": hypers[bucket.group].to_wire()},
        )
        self._sending.append((self._clients[bucket.node].send(header, buffer), buffer))
        self._pushed.add(bucket_id)

    def _send_buffer(self, numel: int) -> torch.Tensor:
        """A send buffer of ``numel`` wire elements that no zero-copy send still reads."""
        still_sending = []
        for handle, buffer in self._sending:
            if handle.done():
                self._free_buffers.setdefault(buffer.numel(), []).append(buffer)
            else:
                still_sending.append((handle, buffer))
        self._sending = still_sending
        free = self._free_buffers.get(numel)
        if free:
            return free.pop()
        return torch.empty(numel, dtype=self._wire_dtype, pin_memory=self._pin)

    def release_send_buffers(self) -> None:
        """Drop the pooled send buffers (layer-wise workers keep no gradient memory between steps)."""
        self._free_buffers.clear()

    def advance(self, bucket_ids: Sequence[int]) -> None:
        """Layer-wise: the pushed buckets' step is over for this worker (their values come on request)."""
        for bucket_id in bucket_ids:
            self.bucket_steps[bucket_id] += 1
        self._pushed.difference_update(bucket_ids)
        self._skipped.difference_update(bucket_ids)

    def finish_step(self, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> None:
        """Push every bucket not pushed yet, then install each bucket's new values as it comes back."""
        self._step_grads = (grads, hypers)  # a node that restarts mid-step gets them again
        for bucket in self.buckets:
            if bucket.bucket_id not in self._pushed:
                self.push_bucket(bucket.bucket_id, grads, hypers)
        for bucket_id in sorted(self._skipped):  # their new values went to the process this one replaces
            self.request(bucket_id, self.bucket_steps[bucket_id] + 1)
        self._skipped.clear()
        waiting = self._waiting = set(range(len(self.buckets)))
        self.on_params = lambda index, message: self._install(index, message, waiting, expect_next_step=True)
        try:
            self.receive_until(lambda: not waiting, lambda: f"no parameters for {len(waiting)} bucket(s)")
        finally:
            self.on_params = None
            self._pushed.clear()
            self._step_grads = None
            self._waiting = set()
            self._reconnected = False

    @property
    def pushed(self) -> frozenset[int]:
        """Buckets already pushed for the step in progress."""
        return frozenset(self._pushed)

    def receive_until(self, done: Callable[[], bool], missing: Callable[[], str]) -> None:
        """Handle what the nodes send until ``done()``; ``TimeoutError`` (with ``missing()`` and each
        node's account of what it waits for) when nothing moves for ``timeout_s``.

        PARAMS go to ``on_params``; NOTICEs are logged; rank 0 answers the nodes' norm partials of a
        clipped step here, whatever it was waiting for; an ERROR raises :class:`NodeError`. Silent
        nodes are pinged, and one gone silent is reconnected to (see :mod:`gpu_worker.liveness`)."""
        self._liveness.start_waiting()
        deadline = time.monotonic() + self.timeout_s
        check_at = time.monotonic() + self.timeouts.heartbeat_s  # silence is looked at once a heartbeat, not per message
        while not done():
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(self._diagnose_timeout(missing()))
            if now >= check_at:
                check_at = now + self.timeouts.heartbeat_s / 2
                for index in self._liveness.gone():
                    self._reconnect(index)
                    deadline = time.monotonic() + self.timeout_s
                for index in self._liveness.to_ping():
                    self._clients[index].send(Header(msg_type=MsgType.QUERY, rank=self.rank))
            ready = self._transport.wait_readable(self._clients, max(min(deadline - now, self.timeouts.heartbeat_s), 0.0))
            for index in ready:
                message = self._clients[index].recv(0.0)
                if message is None:
                    continue
                self._liveness.heard(index)
                if message.header.msg_type != MsgType.STATUS:  # a STATUS answers a ping: alive, not progress
                    deadline = time.monotonic() + self.timeout_s
                    self._dispatch(index, message)

    def _dispatch(self, index: int, message: Message) -> None:
        header = message.header
        if header.msg_type == MsgType.ERROR:
            raise NodeError(self.nodes[index], header.meta.get("code", 0), header.meta.get("message", ""))
        if header.msg_type == MsgType.NOTICE:
            self._log_notice(index, header)
            return
        if header.msg_type == MsgType.CONSUMED:
            self._unconsumed.pop(header.bucket_id, None)
            return
        if header.msg_type == MsgType.NORM_PARTIAL:
            self._on_norm_partial(index, header)
            return
        if header.msg_type != MsgType.PARAMS or self.on_params is None:
            raise RuntimeError(f"unexpected {header.msg_type.name} from node {self.nodes[index]}")
        if "grad_norm" in header.meta:
            self.last_grad_norm = float(header.meta["grad_norm"])
        if self._requests.get(header.bucket_id) == header.step:
            del self._requests[header.bucket_id]
        self.on_params(index, message)

    def _on_norm_partial(self, index: int, header: Header) -> None:
        """Rank 0: add the nodes' shares of the squared norm in node order and send the total to all.
        A node that restarted after the total went out asks again: it gets the same total."""
        nodes_with_buckets = sorted({b.node for b in self.buckets})
        if self._last_clip is not None and self._last_clip[0] == header.step:
            self._clients[index].send(Header(msg_type=MsgType.CLIP, rank=self.rank, step=header.step, meta={"sum_of_squares": self._last_clip[1]}))
            return
        self._norm_partials[index] = float(header.meta["sum_of_squares"])
        if len(self._norm_partials) == len(nodes_with_buckets):
            total = sum(self._norm_partials[n] for n in nodes_with_buckets)  # node order: deterministic
            self._norm_partials.clear()
            self._last_clip = (header.step, total)
            for node in nodes_with_buckets:
                self._clients[node].send(Header(msg_type=MsgType.CLIP, rank=self.rank, step=header.step, meta={"sum_of_squares": total}))

    # ---------------------------------------------------------------- a node that went away

    def _reconnect(self, index: int) -> None:
        """Reach node ``index`` again at the address it was given (its same-host socket may be gone
        with it) and continue where it is: push again what it lost, ask again for what is awaited."""
        address = self.nodes[index]
        silent = self._liveness.silent_for(index)
        log.warning("rank %d: node %s has not answered for %.0f s; reconnecting (for up to %.0f s)", self.rank, address, silent, self.timeouts.reconnect_s)
        self._clients[index].close()
        self._clients[index] = self._transport.connect(address)
        self._send_hello(index)
        try:
            reply = self._registered(index, self.timeouts.reconnect_s)
        except TimeoutError:
            raise ConnectionError(
                f"rank {self.rank}, step {self.step}: node {address} stopped answering {silent:.0f} s ago and did not come back within "
                f"{self.timeouts.reconnect_s:.0f} s: restart it with the same flags plus --resume (the workers reconnect by themselves), or check the network"
            ) from None
        self._resync(index, reply)

    def _resync(self, index: int, reply: Message) -> None:
        self._reconnected = True
        meta = reply.header.meta
        address = self.nodes[index]
        mine = [b.bucket_id for b in self.buckets if b.node == index]
        step = min(self.bucket_steps[b] for b in mine) if mine else 0
        node_step, contributed = int(meta["resume_step"]), {int(b) for b in meta["contributed"]}
        if meta.get("needs_init"):
            raise RuntimeError(
                f"node {address} came back without the job's state (restarted without --resume?): its buckets need initial values again; "
                "restart it with --resume from its checkpoints, then the workers"
            )
        if node_step < step:
            raise RuntimeError(
                f"node {address} came back at step {node_step}, but rank {self.rank} is at step {step} (the node resumed from an older checkpoint): "
                f"continuing would mix steps. To roll the job back to step {node_step}, restart every worker (they resume at the nodes' step); "
                f"otherwise restart the node from a checkpoint of step {step}"
            )
        if node_step > step + 1:
            raise RuntimeError(f"node {address} is at step {node_step}, rank {self.rank} at step {step}: this worker is not part of that run")
        lost = [b for b in mine if node_step == step and b in self._pushed and b not in contributed]
        if lost and self._step_grads is None:
            raise RuntimeError(
                f"node {address} restarted in the middle of step {step} and lost this worker's gradients of {len(lost)} bucket(s), which layer-wise "
                f"workers do not keep: restart the worker (it redoes step {step})"
            )
        log.warning("rank %d: node %s is back at step %d; pushing %d bucket(s) again", self.rank, address, node_step, len(lost))
        for bucket_id in lost:
            if self.bucket_steps[bucket_id] > step:  # installed from the node's previous life: it comes again
                self.bucket_steps[bucket_id] = step
                self._waiting.add(bucket_id)
        # Ask first: a request that reaches the node before the push that completes the bucket is
        # answered once, at the update, instead of the update's broadcast.
        asked = dict(self._requests)  # what the node's previous life was asked for
        asked.update({b: self.bucket_steps[b] + 1 for b in self._waiting})
        for bucket_id, at_step in sorted(asked.items()):
            if self.buckets[bucket_id].node == index:
                self.request(bucket_id, at_step)
        if lost:
            grads, hypers = self._step_grads  # type: ignore[misc]
            for bucket_id in lost:
                self._pushed.discard(bucket_id)
                self.push_bucket(bucket_id, grads, hypers)

    def _install(self, node_index: int, message: Message, waiting: set[int], expect_next_step: bool) -> None:
        header = message.header
        bucket_id = header.bucket_id
        if self._reconnected and bucket_id not in waiting and 0 <= bucket_id < len(self.buckets) and header.step == self.bucket_steps[bucket_id]:
            return  # after a reconnect, values already installed can come twice (asked for again and broadcast)
        if bucket_id not in waiting or self.buckets[bucket_id].node != node_index:
            raise RuntimeError(f"node {self.nodes[node_index]} sent bucket {bucket_id}, which this worker did not ask it for")
        bucket = self.buckets[bucket_id]
        if header.numel != bucket.numel or header.dtype != self.job.wire_dtype:
            raise RuntimeError(
                f"node {self.nodes[node_index]} sent bucket {bucket_id} as {header.numel} x {header.dtype}, expected {bucket.numel} x {self.job.wire_dtype}"
            )
        expected = self.bucket_steps[bucket_id] + (1 if expect_next_step else 0)
        if header.step != expected:
            raise RuntimeError(f"node {self.nodes[node_index]} sent bucket {bucket_id} of step {header.step}, expected step {expected}")
        scatter_bucket(bucket, message.tensors, self.params)
        self.bucket_steps[bucket_id] = header.step
        waiting.discard(bucket_id)

    # ---------------------------------------------------------------- errors

    def _log_notice(self, node_index: int, header: Header) -> None:
        if header.meta.get("waiting_for"):
            log.info("node %s: %s", self.nodes[node_index], header.meta["waiting_for"])
        elif header.meta.get("paused"):
            log.warning("node %s paused updates: %s; this worker waits (timeout %.0f s)", self.nodes[node_index], header.meta.get("reason"), self.timeout_s)
        else:
            log.warning("node %s resumed updates", self.nodes[node_index])

    def _expect(self, node_index: int, msg_type: MsgType, what: str, *, first_answer_s: float | None = None) -> Message:
        """The node's next answer, which must be ``msg_type``. The first message must come within
        ``first_answer_s`` (default ``timeout_s``); after a NOTICE (the node is alive, e.g. waiting for
        rank 0) the answer may take ``timeout_s`` more."""
        timeout_s = self.timeout_s if first_answer_s is None else first_answer_s
        message = self._clients[node_index].recv(timeout_s)
        while message is not None and message.header.msg_type in (MsgType.NOTICE, MsgType.STATUS):
            if message.header.msg_type == MsgType.NOTICE:
                self._log_notice(node_index, message.header)
                timeout_s = self.timeout_s
            message = self._clients[node_index].recv(timeout_s)
        if message is None:
            raise TimeoutError(f"rank {self.rank}: node {self.nodes[node_index]} did not answer within {timeout_s:.0f} s while waiting for {what}")
        header = message.header
        if header.msg_type == MsgType.ERROR:
            raise NodeError(self.nodes[node_index], header.meta.get("code", 0), header.meta.get("message", ""))
        if header.msg_type != msg_type:
            raise RuntimeError(f"node {self.nodes[node_index]} answered {header.msg_type.name}, expected {msg_type.name}")
        return message

    def _diagnose_timeout(self, missing: str) -> str:
        """The timeout's message: what this worker misses and, per node, what the node waits for."""
        lines = [f"rank {self.rank}, step {self.step}: {missing} after {self.timeout_s:.0f} s"]
        lines += [
            f"node {self.nodes[index]}: {account}" for index, account in enumerate(ask_what_nodes_wait_for(self._clients, self.rank, min(5.0, self.timeout_s)))
        ]
        return "; ".join(lines)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for client in self._clients:
            client.close()
        self._transport.close()


def _reachable_here(address: str) -> bool:
    """An ipc:// address whose socket file exists on this host (a node elsewhere has its own)."""
    if not address.startswith("ipc://"):
        return False
    try:
        return stat.S_ISSOCK(os.stat(address[len("ipc://") :]).st_mode)
    except OSError:
        return False
