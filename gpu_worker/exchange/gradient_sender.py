"""How a worker's gradients leave it: gathered straight into a same-host node's shared window where
there is room, else into pooled send buffers, and sent as PUSH messages."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from gpu_worker.exchange.finite_probe import FiniteProbe
from gpu_worker.layerwise.device_copy import host_waitable_event, in_page_locked_window, wait_for_stream, wait_on_host
from gpu_worker.layout import gather_run
from gpu_worker.links.connections import NodeConnections
from protos.job.hyper import AdamWHyper
from protos.job.placement import BucketSpec
from transport.send_buffers import SendBuffers
from transport.wire import MsgType, tensor_header


class GradientSender:
    """Sends one bucket's gradient, or those of consecutive buckets of one node, as one PUSH, with the
    param group's hyperparameters encoded once while they hold. The gradient is gathered (and cast)
    into the node's shared window where the node is on this host and its window has room (sending it
    then copies nothing; the node credits the bytes back once it used them), else into a send
    buffer of the wire dtype that is reused once its send is done. A worker vouches for a gradient
    whose sum is finite: on a GPU summed on the device, on the CPU summed as gathered
    (:mod:`gpu_worker.exchange.finite_probe`)."""

    def __init__(self, connections: NodeConnections, wire_dtype: torch.dtype, *, pin_memory: bool, bucket_count: int = 1) -> None:
        self._connections = connections
        self._probe = FiniteProbe(max(1, bucket_count), wire_dtype)
        self._buffers = SendBuffers(wire_dtype, pin_memory=pin_memory)
        self._hyper_wire: dict[int, tuple[AdamWHyper, dict]] = {}  # group -> its hyperparameters as last sent
        self._staged: dict[
            int, tuple[torch.Tensor, torch.cuda.Event | None, int | None, bool | None]
        ] = {}  # bucket -> its gathered gradient, the copy's event, the node whose window holds it, its word (see push)
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.staged_pushes = 0  # pushes sent from a staged gradient (counted for tests and benchmarks)
        self.in_place_bytes = 0  # gradient bytes gathered straight into a node's shared window

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
            self._give_back(previous)
        sources = [grads[seg.param_index] for seg in bucket.segments]
        device = sources[0].device
        buffer, window_of = self._take(bucket.node, bucket.numel, cuda=device.type == "cuda")
        event = None
        word: bool | None = False
        if device.type == "cuda" and (window_of is not None or buffer.is_pinned()):
            stream = self._copy_streams.get(device)
            if stream is None:
                stream = self._copy_streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # after the kernels that made the gradients
            with torch.cuda.stream(stream):
                gather_run((bucket,), grads, buffer)
                word = None if self._probe.queue(bucket, grads) else False
                event = host_waitable_event()
                event.record(stream)
            for source in sources:  # the allocator must not reuse their memory before the copies ran
                source.record_stream(stream)
        else:
            gather_run((bucket,), grads, buffer)
            word = device.type != "cuda" and self._probe.gathered_finite(buffer)
        self._staged[bucket.bucket_id] = (buffer, event, window_of, word)

    def is_staged(self, bucket_id: int) -> bool:
        """Whether the bucket's gradient is staged, waiting for :meth:`push`."""
        return bucket_id in self._staged

    def staged_landed(self, bucket_id: int) -> bool:
        """Whether the bucket's staged copies are done (True where none are staged); never waits."""
        staged = self._staged.get(bucket_id)
        return staged is None or staged[1] is None or staged[1].query()

    def wait_staged(self, bucket_id: int) -> None:
        """Block until the bucket's staged copies are done (without the GIL); nothing if none are."""
        staged = self._staged.get(bucket_id)
        if staged is not None and staged[1] is not None:
            wait_on_host(staged[1])

    def _take(self, node: int, numel: int, *, cuda: bool) -> tuple[torch.Tensor, int | None]:
        """Where to gather ``numel`` elements for ``node``: its shared window, where it has room (on a
        GPU only once the window is page-locked, so that the device's copies into it are
        asynchronous), with ``node``; else a pooled send buffer, with ``None``."""
        reserved = self._connections.reserve(node, numel * self._buffers.dtype.itemsize)
        if reserved is not None:
            if not cuda or in_page_locked_window(reserved):
                return reserved.view(self._buffers.dtype), node
            self._connections.cancel(node, reserved)
        return self._buffers.take(numel), None

    def _give_back(self, staged: tuple[torch.Tensor, torch.cuda.Event | None, int | None, bool | None]) -> None:
        """A staged gradient that will not be sent: its place is free again once its copies are done."""
        buffer, event, window_of, _word = staged
        if event is not None:
            wait_on_host(event)
        if window_of is None:
            self._buffers.give_back(buffer)
        else:
            self._connections.cancel(window_of, buffer)

    def drop_staged(self) -> None:
        """Staged gradients that were not sent (a bucket batched with others, or already with its
        node): their places go back once their copies are done."""
        for staged in self._staged.values():
            self._give_back(staged)
        self._staged.clear()

    def push(self, run: Sequence[BucketSpec], grads: Sequence[torch.Tensor | None], *, rank: int, step: int, meta: dict) -> float:
        """Gather ``run``'s gradients (``grads[i]`` belongs to parameter ``i``; ``None`` counts as
        zeros), or take a lone bucket's staged gather (:meth:`stage`), and send them to the run's node
        as one PUSH named after its first bucket; returns the seconds the gather took. A lone bucket's
        ``meta`` gets ``finite`` where its sum (on the device, or of the gathered values) proved it finite."""
        started = time.perf_counter()
        staged = self._staged.pop(run[0].bucket_id, None) if len(run) == 1 else None
        first = run[0]
        word: bool | None = False  # the worker's word that the gradient is finite; None: its sum was queued on the device, read once copied
        if staged is not None:
            buffer, event, window_of, word = staged
            if event is not None:
                wait_on_host(event)  # its copies were queued during backward
            self.staged_pushes += 1
        else:
            cuda = self._buffers.pin_memory  # the session's parameters are on a GPU (no per-push scan of them)
            buffer, window_of = self._take(first.node, sum(bucket.numel for bucket in run), cuda=cuda)
            gather_run(run, grads, buffer)
            if cuda:
                word = None if len(run) == 1 and self._probe.queue(first, grads) else False
                wait_for_stream(torch.cuda.current_stream())  # the device-to-host copies were asynchronous
            else:  # summed while the gather is still in cache
                word = len(run) == 1 and self._probe.gathered_finite(buffer)
        if word is None:
            word = self._probe.proven_finite(first.bucket_id)
        if word:
            meta["finite"] = True
        gathered = time.perf_counter() - started
        header = tensor_header(MsgType.PUSH, buffer, rank=rank, step=step, bucket_id=first.bucket_id, meta=meta)
        handle = self._connections.send(first.node, header, buffer)
        if window_of is None:
            self._buffers.lend(first.node, handle, buffer)
        else:  # the node credits the window's bytes back once it used them
            self.in_place_bytes += buffer.numel() * buffer.element_size()
        return gathered

    def set_bucket_count(self, bucket_count: int) -> None:
        """The job has ``bucket_count`` buckets now (a param group was added, between steps)."""
        self._probe.resize(bucket_count)

    def forget(self, node: int) -> None:
        """Node ``node``'s connection is being replaced: its sends in flight will not complete."""
        self._buffers.forget(node)

    def release(self) -> None:
        """Drop the pooled buffers (layer-wise workers keep no gradient memory between steps)."""
        self.drop_staged()
        self._buffers.clear()

    @property
    def vouched_pushes(self) -> int:
        """Pushes sent with the worker's word that the gradient is finite."""
        return self._probe.vouched

    @property
    def buffers_allocated(self) -> int:
        """Send buffers made so far (after warm-up, a step should make none)."""
        return self._buffers.allocated
