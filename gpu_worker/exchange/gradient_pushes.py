"""A worker rank's gradient pushes of the step in progress.

Each bucket's gradient goes to the node that owns it once per step: as soon as it is final (during
backward: :meth:`GradientPushes.push_bucket`, or staged out of the device first and pushed from
there), or in ``step()`` with whatever was not pushed yet (:meth:`GradientPushes.push_remaining`),
where runs of small buckets for one node go as one message. A rank that redoes a step its
predecessor left unfinished does not push what the nodes already hold of it; those buckets' values
are asked for instead. With a push window (:mod:`gpu_worker.exchange.push_pacing`), a push first waits for
room, receiving what the nodes send meanwhile (``wait_for_room``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from gpu_worker.exchange.gradient_sender import GradientSender
from gpu_worker.exchange.push_pacing import PushPacer
from gpu_worker.links.step_timings import elapsed
from protos.job.hyper import AdamWHyper
from protos.job.placement import BucketSpec
from transport.batches import BATCH_BYTES
from transport.wire import Header, MsgType

if TYPE_CHECKING:
    from gpu_worker.links.connections import NodeConnections
    from gpu_worker.links.rank_state import RankState


WaitForRoom = Callable[[PushPacer, int, Sequence[torch.Tensor | None], Sequence[AdamWHyper]], None]
"""``wait_for_room(pacer, nbytes, grads, hypers)``: block until ``nbytes`` more fit the push window,
receiving what the nodes send meanwhile (the session's, which holds the receive loop)."""


class GradientPushes:
    """Which buckets this rank pushed for the step in progress, and the pushes themselves.

    ``contributed``: buckets of ``resume_step`` whose gradient from this rank the nodes hold already
    (pushed by the process this one replaces); ``skipped``: pushes of this step left out for that
    reason, whose new values are asked for; ``batching_nodes``: nodes that take several small
    buckets per message. ``pacer`` (acknowledged by ``pacer_ack``): the push window, if any; a push
    beyond it first calls ``wait_for_room``."""

    def __init__(
        self,
        state: RankState,
        connections: NodeConnections,
        wire_dtype: torch.dtype,
        *,
        pin_memory: bool,
        pacer: PushPacer | None,
        pacer_ack: MsgType,
        wait_for_room: WaitForRoom,
    ) -> None:
        self._state = state
        self._connections = connections
        self._wire_dtype = wire_dtype
        self._pacer = pacer
        self._pacer_ack = pacer_ack
        self._wait_for_room = wait_for_room
        self.sender = GradientSender(connections, wire_dtype, pin_memory=pin_memory, bucket_count=len(state.buckets))
        self.pushed: dict[int, int] = {}  # bucket -> the step its gradient was pushed for, in the step in progress
        self.contributed: set[int] = set()
        self.skipped: set[int] = set()
        self.batching_nodes: set[int] = set()

    def push_bucket(self, bucket_id: int, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> None:
        """Send one bucket's gradient for the current step now (``grads[i]`` belongs to ``params[i]``;
        ``hypers[g]``: param group ``g``'s hyperparameters for this step)."""
        state = self._state
        if bucket_id in self.pushed:
            raise RuntimeError(f"bucket {bucket_id} was already pushed for step {state.bucket_steps[bucket_id]}")
        bucket = state.buckets[bucket_id]
        if self.node_has_gradient(bucket_id):
            self.contributed.discard(bucket_id)  # the node has this rank's gradient of this step already
            self.skipped.add(bucket_id)
            self.pushed[bucket_id] = state.bucket_steps[bucket_id]
            return
        pacer = self._pacer
        if pacer is not None:
            nbytes = bucket.numel * self._wire_dtype.itemsize if any(grads[seg.param_index] is not None for seg in bucket.segments) else 0
            self._wait_for_room(pacer, nbytes, grads, hypers)
            pacer.pushed(bucket_id, nbytes)
        meta: dict = {"hyper": self.sender.hyper_meta(bucket.group, hypers)}
        # Parameters without a gradient on this rank: zeros in the sum, as with DDP; not stepped if no rank has one.
        absent = [index for index, seg in enumerate(bucket.segments) if grads[seg.param_index] is None]
        if absent:
            meta["absent"] = absent
        step = state.bucket_steps[bucket_id]
        timings = state.timings
        if len(absent) == len(bucket.segments):  # no gradient for any of its parameters (a frozen layer): no payload
            sending = time.perf_counter()
            self._connections.send(bucket.node, Header(msg_type=MsgType.PUSH, rank=state.rank, step=step, bucket_id=bucket_id, meta=meta))
        else:
            started = time.perf_counter()
            gathered = self.sender.push((bucket,), grads, rank=state.rank, step=step, meta=meta)
            timings.gather_s += gathered
            sending = started + gathered
        self.pushed[bucket_id] = step
        timings.send_s += elapsed(sending)
        timings.pushes += 1

    def stage_bucket(self, bucket_id: int, grads: Sequence[torch.Tensor | None]) -> bool:
        """Start copying a final bucket's gradients out of the device, for :meth:`push_bucket` to send
        from there; buckets that go in a batch, or hold a parameter without a gradient, are not staged.
        True where the bucket was staged."""
        bucket = self._state.buckets[bucket_id]
        if self.small_for_batches(bucket):
            return False
        if bucket_id in self.pushed or self.node_has_gradient(bucket_id):
            return False
        if any(grads[seg.param_index] is None for seg in bucket.segments):
            return False
        self.sender.stage(bucket, grads)
        return True

    def push_staged(self, bucket_id: int, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> None:
        """Push a staged bucket now, unless it went already."""
        if bucket_id not in self.pushed and self.sender.is_staged(bucket_id):
            self.push_bucket(bucket_id, grads, hypers)

    def push_remaining(self, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> None:
        """Push every bucket not pushed yet: runs of small ones for one node (same param group, every
        parameter with a gradient) as batches, the rest one by one."""
        state = self._state
        run: list[BucketSpec] = []
        run_bytes = 0
        for bucket in state.buckets:
            if bucket.bucket_id in self.pushed:
                continue
            nbytes = bucket.numel * self._wire_dtype.itemsize
            batchable = (
                self.small_for_batches(bucket)
                and (self._pacer is None or self._pacer_ack == MsgType.PARAMS)
                and not self.node_has_gradient(bucket.bucket_id)
                and all(grads[seg.param_index] is not None for seg in bucket.segments)
            )
            if run and (not batchable or bucket.node != run[0].node or bucket.group != run[0].group or run_bytes >= BATCH_BYTES):
                self.push_run(run, grads, hypers)
                run, run_bytes = [], 0
            if batchable:
                run.append(bucket)
                run_bytes += nbytes
            else:
                self.push_bucket(bucket.bucket_id, grads, hypers)
        if run:
            self.push_run(run, grads, hypers)

    def push_run(self, run: Sequence[BucketSpec], grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> None:
        """Push buckets of one node and param group, all at one step, in one message (one alone as it is)."""
        if len(run) == 1:
            self.push_bucket(run[0].bucket_id, grads, hypers)
            return
        state = self._state
        started = time.perf_counter()
        first = run[0]
        step = state.bucket_steps[first.bucket_id]
        meta = {"hyper": self.sender.hyper_meta(first.group, hypers), "batch": [[bucket.bucket_id, bucket.numel] for bucket in run]}
        gathered = self.sender.push(run, grads, rank=state.rank, step=step, meta=meta)
        timings = state.timings
        timings.gather_s += gathered
        sending = started + gathered
        self.pushed.update((bucket.bucket_id, step) for bucket in run)
        timings.send_s += elapsed(sending)
        timings.pushes += len(run)

    def node_has_gradient(self, bucket_id: int) -> bool:
        """Whether the node holds this rank's gradient of the bucket for the step being redone already
        (pushed by the process this one replaces): it is not pushed again."""
        return bucket_id in self.contributed and self._state.bucket_steps[bucket_id] == self._state.resume_step

    def small_for_batches(self, bucket: BucketSpec) -> bool:
        """Whether the bucket is small enough to go in a batch, to a node that takes batches."""
        return bucket.node in self.batching_nodes and bucket.numel * self._wire_dtype.itemsize < BATCH_BYTES
