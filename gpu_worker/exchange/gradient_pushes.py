"""A worker rank's gradient pushes of the step in progress.

Each bucket's gradient goes to the node that owns it once per step: as soon as it is final (during
backward: :meth:`GradientPushes.push_bucket`, or staged out of the device first and pushed from
there), or in ``step()`` with whatever was not pushed yet (:meth:`GradientPushes.push_remaining`),
where runs of small buckets for one node go as one message. A rank that redoes a step its
predecessor left unfinished does not push what the nodes already hold of it; those buckets' values
are asked for instead. With a push window (:mod:`gpu_worker.exchange.push_pacing`), a push first waits for
room, through the session that receives what the nodes send.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from gpu_worker.exchange.gradient_sender import GradientSender
from gpu_worker.links.step_timings import WorkerStepTimings, elapsed
from netoptim.job.hyper import AdamWHyper
from netoptim.job.placement import BucketSpec
from transport.batches import BATCH_BYTES
from transport.wire import Header, MsgType

if TYPE_CHECKING:
    from gpu_worker.exchange.push_pacing import PushPacer
    from gpu_worker.links.connections import NodeConnections


class PushingSession(Protocol):
    """What the pushes read of the session at each push (each may change between steps), and the
    wait for room in the push window it runs."""

    rank: int
    buckets: list[BucketSpec]
    bucket_steps: list[int]
    resume_step: int
    pacer: PushPacer | None
    pacer_ack: MsgType
    timings: WorkerStepTimings

    def wait_for_room(self, pacer: PushPacer, nbytes: int, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> None: ...


class GradientPushes:
    """Which buckets this rank pushed for the step in progress, and the pushes themselves.

    ``contributed``: buckets of ``resume_step`` whose gradient from this rank the nodes hold already
    (pushed by the process this one replaces); ``skipped``: pushes of this step left out for that
    reason, whose new values are asked for; ``batching_nodes``: nodes that take several small
    buckets per message."""

    def __init__(self, session: PushingSession, connections: NodeConnections, wire_dtype: torch.dtype, *, pin_memory: bool) -> None:
        self._session = session
        self._connections = connections
        self._wire_dtype = wire_dtype
        self.sender = GradientSender(connections, wire_dtype, pin_memory=pin_memory, bucket_count=len(session.buckets))
        self.pushed: dict[int, int] = {}  # bucket -> the step its gradient was pushed for, in the step in progress
        self.contributed: set[int] = set()
        self.skipped: set[int] = set()
        self.batching_nodes: set[int] = set()

    def push_bucket(self, bucket_id: int, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> None:
        """Send one bucket's gradient for the current step now (``grads[i]`` belongs to ``params[i]``;
        ``hypers[g]``: param group ``g``'s hyperparameters for this step)."""
        session = self._session
        if bucket_id in self.pushed:
            raise RuntimeError(f"bucket {bucket_id} was already pushed for step {session.bucket_steps[bucket_id]}")
        bucket = session.buckets[bucket_id]
        if self.node_has_gradient(bucket_id):
            self.contributed.discard(bucket_id)  # the node has this rank's gradient of this step already
            self.skipped.add(bucket_id)
            self.pushed[bucket_id] = session.bucket_steps[bucket_id]
            return
        pacer = session.pacer
        if pacer is not None:
            nbytes = bucket.numel * self._wire_dtype.itemsize if any(grads[seg.param_index] is not None for seg in bucket.segments) else 0
            session.wait_for_room(pacer, nbytes, grads, hypers)
            pacer.pushed(bucket_id, nbytes)
        meta: dict = {"hyper": self.sender.hyper_meta(bucket.group, hypers)}
        # Parameters without a gradient on this rank: zeros in the sum, as with DDP; not stepped if no rank has one.
        absent = [index for index, seg in enumerate(bucket.segments) if grads[seg.param_index] is None]
        if absent:
            meta["absent"] = absent
        step = session.bucket_steps[bucket_id]
        timings = session.timings
        if len(absent) == len(bucket.segments):  # no gradient for any of its parameters (a frozen layer): no payload
            sending = time.perf_counter()
            self._connections.send(bucket.node, Header(msg_type=MsgType.PUSH, rank=session.rank, step=step, bucket_id=bucket_id, meta=meta))
        else:
            started = time.perf_counter()
            gathered = self.sender.push((bucket,), grads, rank=session.rank, step=step, meta=meta)
            timings.gather_s += gathered
            sending = started + gathered
        self.pushed[bucket_id] = step
        timings.send_s += elapsed(sending)
        timings.pushes += 1

    def stage_bucket(self, bucket_id: int, grads: Sequence[torch.Tensor | None]) -> bool:
        """Start copying a final bucket's gradients out of the device, for :meth:`push_bucket` to send
        from there; buckets that go in a batch, or hold a parameter without a gradient, are not staged.
        True where the bucket was staged."""
        bucket = self._session.buckets[bucket_id]
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
        session = self._session
        run: list[BucketSpec] = []
        run_bytes = 0
        for bucket in session.buckets:
            if bucket.bucket_id in self.pushed:
                continue
            nbytes = bucket.numel * self._wire_dtype.itemsize
            batchable = (
                self.small_for_batches(bucket)
                and (session.pacer is None or session.pacer_ack == MsgType.PARAMS)
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
        session = self._session
        started = time.perf_counter()
        first = run[0]
        step = session.bucket_steps[first.bucket_id]
        meta = {"hyper": self.sender.hyper_meta(first.group, hypers), "batch": [[bucket.bucket_id, bucket.numel] for bucket in run]}
        gathered = self.sender.push(run, grads, rank=session.rank, step=step, meta=meta)
        timings = session.timings
        timings.gather_s += gathered
        sending = started + gathered
        self.pushed.update((bucket.bucket_id, step) for bucket in run)
        timings.send_s += elapsed(sending)
        timings.pushes += len(run)

    def node_has_gradient(self, bucket_id: int) -> bool:
        """Whether the node holds this rank's gradient of the bucket for the step being redone already
        (pushed by the process this one replaces): it is not pushed again."""
        return bucket_id in self.contributed and self._session.bucket_steps[bucket_id] == self._session.resume_step

    def small_for_batches(self, bucket: BucketSpec) -> bool:
        """Whether the bucket is small enough to go in a batch, to a node that takes batches."""
        return bucket.node in self.batching_nodes and bucket.numel * self._wire_dtype.itemsize < BATCH_BYTES
