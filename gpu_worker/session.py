"""A worker's connections to the optimizer nodes of its job.

:class:`OffloadSession` registers the layout, pulls the current parameters and runs one step: push
every gradient bucket, then install each bucket's new values as the owning node sends them back. It
knows nothing of ``torch.optim``; :class:`gpu_worker.RemoteAdamW` is the optimizer facade over it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from gpu_worker.layout import gather_bucket, scatter_bucket
from optimizer_node.adamw import AdamWHyper
from optimizer_node.job import JobSpec
from optimizer_node.placement import BucketSpec
from transport import create_transport
from transport.interface import ClientEndpoint, Message
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
        self, nodes: Sequence[str], job: JobSpec, rank: int, params: Sequence[torch.Tensor], *, timeout_s: float, curve: CurveClientConfig | None = None
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
        self.timeout_s = timeout_s
        self.buckets: list[BucketSpec] = job.plan()
        self.bucket_steps = [0] * len(self.buckets)
        self.last_grad_norm: float | None = None
        self._wire_dtype = WIRE_DTYPES[job.wire_dtype]
        pin = any(p.device.type == "cuda" for p in self.params) and torch.cuda.is_available()
        # Reused send buffers, one per bucket: a buffer is rewritten only after its reply came back,
        # so the zero-copy send that read it has finished. Pinned when gradients come from a GPU.
        self._send_buffers = [torch.empty(b.numel, dtype=self._wire_dtype, pin_memory=pin) for b in self.buckets]
        self._transport = create_transport(self.nodes[0], curve_client=curve)
        self._curve = curve
        self._clients: list[ClientEndpoint] = [self._transport.connect(url) for url in self.nodes]
        self._pushed: set[int] = set()
        self._closed = False

    # ---------------------------------------------------------------- setup

    @property
    def step(self) -> int:
        """The step the nodes are at for this worker: every bucket has had this many updates."""
        return min(self.bucket_steps, default=0)

    def connect(self) -> None:
        """Register (rank 0) or check (other ranks) the layout, then pull the current parameters."""
        hello = {"job": self.job.to_wire()}
        for index, client in enumerate(self._clients):
            client.send(Header(msg_type=MsgType.HELLO, rank=self.rank, meta={**hello, "node_index": index}))
        needs_init: list[int] = []
        for index in range(len(self._clients)):
            hint = "is the node running and reachable" + (
                "; is this worker's public key in the node's --curve-allow directory, and curve_server_key the node's key"
                if self._curve
                else "; if the node uses CURVE, give this worker its keys"
            )
            reply = self._expect(index, MsgType.HELLO_OK, f"registration (rank 0 registers the job; {hint}?)")
            owned = sorted(b.bucket_id for b in self.buckets if b.node == index)
            if reply.header.meta.get("owned") != owned:
                raise RuntimeError(f"node {self.nodes[index]} owns buckets {reply.header.meta.get('owned')}, the plan says {owned}")
            needs_init += reply.header.meta.get("needs_init", [])
        if needs_init and self.rank == 0:
            log.info("registering initial values of %d buckets", len(needs_init))
            for bucket_id in needs_init:
                bucket = self.buckets[bucket_id]
                initial = torch.empty(bucket.numel, dtype=torch.float32)
                gather_bucket(bucket, self.params, initial)
                self._clients[bucket.node].send(tensor_header(MsgType.INIT, initial, rank=self.rank, bucket_id=bucket_id), initial)
                self._expect(bucket.node, MsgType.ACK, f"initial values of bucket {bucket_id}")
        for bucket in self.buckets:
            self._clients[bucket.node].send(Header(msg_type=MsgType.PULL, rank=self.rank, bucket_id=bucket.bucket_id))
        self._receive_params(set(range(len(self.buckets))), expect_next_step=False)
        log.info("rank %d connected to %d node(s); the job is at step %d", self.rank, len(self.nodes), self.step)

    # ---------------------------------------------------------------- one step

    def push_bucket(self, bucket_id: int, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> None:
        """Send one bucket's gradient for the current step now (``grads[i]`` belongs to ``params[i]``).

        ``hypers[g]`` are the hyperparameters of param group ``g`` for this step. Buckets not pushed
        before :meth:`finish_step` are pushed there.
        """
        if bucket_id in self._pushed:
            raise RuntimeError(f"bucket {bucket_id} was already pushed for step {self.bucket_steps[bucket_id]}")
        bucket, buffer = self.buckets[bucket_id], self._send_buffers[bucket_id]
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
        self._clients[bucket.node].send(header, buffer)
        self._pushed.add(bucket_id)

    def finish_step(self, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> None:
        """Push every bucket not pushed yet, then install each bucket's new values as it comes back."""
        for bucket in self.buckets:
            if bucket.bucket_id not in self._pushed:
                self.push_bucket(bucket.bucket_id, grads, hypers)
        try:
            self._receive_params(set(range(len(self.buckets))), expect_next_step=True)
        finally:
            self._pushed.clear()

    @property
    def pushed(self) -> frozenset[int]:
        """Buckets already pushed for the step in progress."""
        return frozenset(self._pushed)

    def _receive_params(self, waiting: set[int], *, expect_next_step: bool) -> None:
        partials: dict[int, float] = {}
        nodes_with_buckets = sorted({b.node for b in self.buckets})
        deadline = time.monotonic() + self.timeout_s
        while waiting:
            remaining = deadline - time.monotonic()
            ready = self._transport.wait_readable(self._clients, max(remaining, 0.0))
            if not ready:
                raise TimeoutError(self._diagnose_timeout(waiting))
            for index in ready:
                message = self._clients[index].recv(0.0)
                if message is None:
                    continue
                header = message.header
                if header.msg_type == MsgType.ERROR:
                    raise NodeError(self.nodes[index], header.meta.get("code", 0), header.meta.get("message", ""))
                if header.msg_type == MsgType.NOTICE:
                    self._log_notice(index, header)
                    continue
                if header.msg_type == MsgType.NORM_PARTIAL:
                    partials[index] = float(header.meta["sum_of_squares"])
                    if len(partials) == len(nodes_with_buckets):
                        total = sum(partials[n] for n in nodes_with_buckets)  # node order: deterministic
                        for node in nodes_with_buckets:
                            self._clients[node].send(Header(msg_type=MsgType.CLIP, rank=self.rank, step=header.step, meta={"sum_of_squares": total}))
                    continue
                if header.msg_type != MsgType.PARAMS:
                    raise RuntimeError(f"unexpected {header.msg_type.name} from node {self.nodes[index]}")
                self._install(index, message, waiting, expect_next_step)

    def _install(self, node_index: int, message: Message, waiting: set[int], expect_next_step: bool) -> None:
        header = message.header
        bucket_id = header.bucket_id
        if bucket_id not in waiting or self.buckets[bucket_id].node != node_index:
            raise RuntimeError(f"node {self.nodes[node_index]} sent bucket {bucket_id}, which this worker did not ask it for")
        bucket = self.buckets[bucket_id]
        if header.numel != bucket.numel or header.dtype != self.job.wire_dtype:
            raise RuntimeError(
                f"node {self.nodes[node_index]} sent bucket {bucket_id} as {header.numel} x {header.dtype}, expected {bucket.numel} x {self.job.wire_dtype}"
            )
        if expect_next_step and header.step != self.bucket_steps[bucket_id] + 1:
            raise RuntimeError(f"bucket {bucket_id} came back at step {header.step}, expected {self.bucket_steps[bucket_id] + 1}")
        scatter_bucket(bucket, message.tensors, self.params)
        self.bucket_steps[bucket_id] = header.step
        if "grad_norm" in header.meta:
            self.last_grad_norm = float(header.meta["grad_norm"])
        waiting.discard(bucket_id)

    # ---------------------------------------------------------------- errors

    def _log_notice(self, node_index: int, header: Header) -> None:
        if header.meta.get("paused"):
            log.warning("node %s paused updates: %s; this worker waits (timeout %.0f s)", self.nodes[node_index], header.meta.get("reason"), self.timeout_s)
        else:
            log.warning("node %s resumed updates", self.nodes[node_index])

    def _expect(self, node_index: int, msg_type: MsgType, what: str) -> Message:
        message = self._clients[node_index].recv(self.timeout_s)
        while message is not None and message.header.msg_type == MsgType.NOTICE:
            self._log_notice(node_index, message.header)
            message = self._clients[node_index].recv(self.timeout_s)
        if message is None:
            raise TimeoutError(f"node {self.nodes[node_index]} did not answer within {self.timeout_s:.0f} s while waiting for {what}")
        header = message.header
        if header.msg_type == MsgType.ERROR:
            raise NodeError(self.nodes[node_index], header.meta.get("code", 0), header.meta.get("message", ""))
        if header.msg_type != msg_type:
            raise RuntimeError(f"node {self.nodes[node_index]} answered {header.msg_type.name}, expected {msg_type.name}")
        return message

    def _diagnose_timeout(self, waiting: set[int]) -> str:
        """Ask each node what it is waiting for, to name the missing ranks in the error."""
        lines = [f"rank {self.rank}, step {self.step}: no parameters for {len(waiting)} bucket(s) after {self.timeout_s:.0f} s"]
        for index, client in enumerate(self._clients):
            client.send(Header(msg_type=MsgType.QUERY, rank=self.rank))
            deadline = time.monotonic() + min(5.0, self.timeout_s)
            status = None
            while status is None and time.monotonic() < deadline:
                message = client.recv(max(deadline - time.monotonic(), 0.0))
                if message is not None and message.header.msg_type == MsgType.STATUS:
                    status = message.header.meta
            if status is None:
                lines.append(f"node {self.nodes[index]}: no answer (is it running?)")
                continue
            if status.get("paused"):
                lines.append(f"node {self.nodes[index]}: updates paused by its operator ({status['paused']})")
                continue
            missing_ranks = sorted({rank for _bucket, _step, ranks in status["missing"] for rank in ranks})
            if missing_ranks:
                lines.append(f"node {self.nodes[index]}: waiting for gradients from rank(s) {missing_ranks} on {len(status['missing'])} bucket(s)")
            elif status.get("uninitialized"):
                lines.append(f"node {self.nodes[index]}: {len(status['uninitialized'])} bucket(s) have no initial values: rank 0 never registered them")
            elif status.get("awaiting_clip") is not None:
                lines.append(f"node {self.nodes[index]}: waiting for rank 0 to send the global gradient norm")
            else:
                lines.append(f"node {self.nodes[index]}: waiting for nothing (connected ranks {status['connected_ranks']})")
        return "; ".join(lines)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for client in self._clients:
            client.close()
        self._transport.close()
