"""How a worker's gradients leave it: gathered into pooled send buffers, sent as PUSH messages."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from gpu_worker.layout import gather_run
from gpu_worker.node_connections import NodeConnections
from job.hyper import AdamWHyper
from job.placement import BucketSpec
from transport.send_buffers import SendBuffers
from transport.wire import MsgType, tensor_header


class GradientSender:
    """Sends one bucket's gradient, or those of consecutive buckets of one node, as one PUSH: gathered
    (and cast) into a send buffer of the wire dtype that is reused once its send is done, with the
    param group's hyperparameters encoded once while they hold."""

    def __init__(self, connections: NodeConnections, wire_dtype: torch.dtype, *, pin_memory: bool) -> None:
        self._connections = connections
        self._buffers = SendBuffers(wire_dtype, pin_memory=pin_memory)
        self._hyper_wire: dict[int, tuple[AdamWHyper, dict]] = {}  # group -> its hyperparameters as last sent
        self._staged: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}  # bucket -> its gathered gradient, the copy's event
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.staged_pushes = 0  # pushes sent from a staged gradient (counted for tests and benchmarks)

    def hyper_meta(self, group: int, hypers: Sequence[AdamWHyper]) -> dict:
        """Param group ``group``'s hyperparameters as they go on the wire."""
        hyper = hypers[group]
        cached = self._hyper_wire.get(group)
        if cached is None or cached[0] != hyper:
            cached = self._hyper_wire[group] = (hyper, hyper.to_wire())
        return cached[1]

    def stage(self, bucket: BucketSpec, grads: Sequence[torch.Tensor]) -> None:
        """Start gathering ``bucket``'s final gradients into a send buffer now, for :meth:`push` to send
        in ``step()``. Called from autograd's device thread during backward: on a GPU the copies are
        queued on a side stream behind the work that produced the gradients, so they overlap the rest
        of backward, and nothing waits here."""
        previous = self._staged.pop(bucket.bucket_id, None)
        if previous is not None:  # a retried step's new gradient
            self._buffers.give_back(previous[0])
        buffer = self._buffers.take(bucket.numel)
        sources = [grads[seg.param_index] for seg in bucket.segments]
        event = None
        device = sources[0].device
        if device.type == "cuda" and buffer.is_pinned():
            stream = self._copy_streams.get(device)
            if stream is None:
                stream = self._copy_streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # after the kernels that made the gradients
            with torch.cuda.stream(stream):
                gather_run((bucket,), grads, buffer)
                event = torch.cuda.Event()
                event.record(stream)
            for source in sources:  # the allocator must not reuse their memory before the copies ran
                source.record_stream(stream)
        else:
            gather_run((bucket,), grads, buffer)
        self._staged[bucket.bucket_id] = (buffer, event)

    def drop_staged(self) -> None:
        """Staged gradients that were not sent (a bucket batched with others, or already with its
        node): their buffers go back to the pool once their copies are done."""
        for buffer, event in self._staged.values():
            if event is not None:
                event.synchronize()
            self._buffers.give_back(buffer)
        self._staged.clear()

    def push(self, run: Sequence[BucketSpec], grads: Sequence[torch.Tensor | None], *, rank: int, step: int, meta: dict) -> float:
        """Gather ``run``'s gradients (``grads[i]`` belongs to parameter ``i``; ``None`` counts as
        zeros), or take a lone bucket's staged gather (:meth:`stage`), and send them to the run's node
        as one PUSH named after its first bucket; returns the seconds the gather took."""
        started = time.perf_counter()
        staged = self._staged.pop(run[0].bucket_id, None) if len(run) == 1 else None
        if staged is not None:
            buffer, event = staged
            if event is not None:
                event.synchronize()  # its copies were queued during backward
            self.staged_pushes += 1
        else:
            buffer = self._buffers.take(sum(bucket.numel for bucket in run))
            gather_run(run, grads, buffer)
            if buffer.is_pinned():
                torch.cuda.current_stream().synchronize()  # the device-to-host copies were asynchronous
        gathered = time.perf_counter() - started
        first = run[0]
        header = tensor_header(MsgType.PUSH, buffer, rank=rank, step=step, bucket_id=first.bucket_id, meta=meta)
        self._buffers.lend(first.node, self._connections.send(first.node, header, buffer), buffer)
        return gathered

    def forget(self, node: int) -> None:
        """Node ``node``'s connection is being replaced: its sends in flight will not complete."""
        self._buffers.forget(node)

    def release(self) -> None:
        """Drop the pooled buffers (layer-wise workers keep no gradient memory between steps)."""
        self.drop_staged()
        self._buffers.clear()

    @property
    def buffers_allocated(self) -> int:
        """Send buffers made so far (after warm-up, a step should make none)."""
        return self._buffers.allocated
