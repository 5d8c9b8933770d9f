"""A worker's word that a bucket's gradient is finite, so that its node need not read it again.

The node checks every push for NaN/inf before it touches any state; on the node that is one more read
of every gradient on the memory bus the update is bound by. On the device the same proof is nearly
free: the bucket's gradient is summed there (in fp32) on the stream that copies it out, and the sum
comes back with it. A finite sum proves every element finite (NaN propagates, an inf makes the sum inf
or NaN); the push then carries ``meta["finite"] = True`` and a node with ``--non-finite-check worker``
(the default) takes its word. A sum that is not finite (a NaN or inf, or finite values whose sum
overflows) proves nothing: the push goes without the word and the node counts the culprits itself, so
refusals and skips say what they said before.

The word is given only where the wire carries the gradient as it was summed (its dtype is the wire's):
a cast to a narrower wire dtype can overflow a finite value into inf (fp16 above 65504).

A CPU worker sums what it gathered for the wire (:meth:`FiniteProbe.gathered_finite`), right after the
gather wrote it: a read of the bucket from the worker's cache rather than one more of the node's
memory bus, which serves every worker; the wire's own values are summed, so any wire dtype takes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from protos.job.placement import BucketSpec


class FiniteProbe:
    """Per-bucket fp32 sums of gradients on a device, copied into page-locked host memory.

    One slot a bucket, allocated once (the first bucket staged on a device); a slot is written by
    :meth:`queue` on the copy stream and read by :meth:`proven_finite` once that stream's event for the
    bucket has completed."""

    def __init__(self, bucket_count: int, wire_dtype: torch.dtype) -> None:
        if bucket_count < 1:
            raise ValueError(f"bucket_count must be at least 1, got {bucket_count}")
        self._count = bucket_count
        self._wire_dtype = wire_dtype
        self._device_sums: dict[torch.device, torch.Tensor] = {}
        self._host_sums: torch.Tensor | None = None
        self._host_values: np.ndarray | None = None
        self.vouched = 0  # pushes that carried the word (counted for tests and benchmarks)

    def queue(self, bucket: BucketSpec, grads: Sequence[torch.Tensor | None]) -> bool:
        """Queue the bucket's sum on the current (copy) stream, before the caller records its event;
        False, queueing nothing, where the word could not be given (a cast on the wire). A parameter
        without a gradient is zeros on the wire: it leaves the sum as it is."""
        sources = [
            grad.detach().view(-1)[seg.param_offset : seg.param_offset + seg.numel] for seg in bucket.segments if (grad := grads[seg.param_index]) is not None
        ]
        if not sources or any(source.dtype != self._wire_dtype for source in sources):
            return False
        device = sources[0].device
        sums = self._device_sums.get(device)
        if sums is None:
            sums = self._device_sums[device] = torch.empty(self._count, dtype=torch.float32, device=device)
        if self._host_sums is None:
            self._host_sums = torch.empty(self._count, dtype=torch.float32, pin_memory=device.type == "cuda")
            self._host_values = self._host_sums.numpy()  # read per push: no tensor made for it
        slot = sums[bucket.bucket_id]
        if len(sources) == 1:
            torch.sum(sources[0], dim=0, dtype=torch.float32, out=slot)
        else:
            torch.sum(torch.stack([torch.sum(source, dtype=torch.float32) for source in sources]), dim=0, out=slot)
        self._host_sums[bucket.bucket_id].copy_(slot, non_blocking=True)
        return True

    def resize(self, bucket_count: int) -> None:
        """The job has ``bucket_count`` buckets now (a param group was added, between steps: no sum is
        in flight); the slots are made again on the next :meth:`queue`."""
        if bucket_count < 1:
            raise ValueError(f"bucket_count must be at least 1, got {bucket_count}")
        self._count = bucket_count
        self._device_sums.clear()
        self._host_sums = self._host_values = None

    def gathered_finite(self, gathered: torch.Tensor) -> bool:
        """Whether the fp32 sum of a bucket's gathered gradient (on the host, in the wire's dtype) is
        finite: the word for a CPU worker's push."""
        finite = math.isfinite(float(torch.sum(gathered, dtype=torch.float32)))
        self.vouched += finite
        return finite

    def proven_finite(self, bucket_id: int) -> bool:
        """Whether the bucket's queued sum (its copies done) is finite."""
        assert self._host_values is not None, "proven_finite before any queue"
        finite = math.isfinite(self._host_values[bucket_id])
        self.vouched += finite
        return finite
