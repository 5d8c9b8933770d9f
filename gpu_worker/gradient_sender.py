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

    def hyper_meta(self, group: int, hypers: Sequence[AdamWHyper]) -> dict:
        """Param group ``group``'s hyperparameters as they go on the wire."""
        hyper = hypers[group]
        cached = self._hyper_wire.get(group)
        if cached is None or cached[0] != hyper:
            cached = self._hyper_wire[group] = (hyper, hyper.to_wire())
        return cached[1]

    def push(self, run: Sequence[BucketSpec], grads: Sequence[torch.Tensor | None], *, rank: int, step: int, meta: dict) -> float:
        """Gather ``run``'s gradients (``grads[i]`` belongs to parameter ``i``; ``None`` counts as
        zeros) and send them to the run's node as one PUSH named after its first bucket; returns the
        seconds the gather took."""
        started = time.perf_counter()
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
        self._buffers.clear()

    @property
    def buffers_allocated(self) -> int:
        """Send buffers made so far (after warm-up, a step should make none)."""
        return self._buffers.allocated
