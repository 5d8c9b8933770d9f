"""A layer-wise worker's pushes, sent as their copies out of the device land rather than waited for.

Layer-wise backward pushes each unit's gradients from its hook. Waiting there for the copies out of
the device would hold the thread that launches the rest of backward (autograd's device thread, on a
GPU) until the GPU has drained: the GPU would idle through every unit's copies. Here the hook starts
the copies (``stage``, on a side stream) and returns;
each bucket goes out, in order, at the first hook that finds its copy landed, and the step's end
sends whatever is left, waiting for it. Pushes keep their pacing: a push that finds the push window
full waits for room where it is sent, as before. On the CPU a copy has landed once made, so each
bucket goes out at once, as it did.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import torch

from protos.job.hyper import AdamWHyper
from protos.job.placement import BucketSpec


class _SegmentGrads:
    """The gradients of one bucket's parameters as they were when it was staged (the unit's ``grad``
    attributes are cleared right after: its copies hold the memory until they have read it)."""

    __slots__ = ("_grads",)

    def __init__(self, grads: dict[int, torch.Tensor | None]) -> None:
        self._grads = grads

    def __getitem__(self, param_index: int) -> torch.Tensor | None:
        return self._grads.get(param_index)


class LandedPushes:
    """Buckets staged for a push, sent in order once their copies out of the device have landed.

    ``buckets``: the job's buckets (a layer-wise job's never change); ``stage(bucket_id, grads)``:
    start a bucket's copy out of the device, False where it is not staged; ``push(bucket_id, grads,
    hypers)``: send a bucket (waiting for its staged copy); ``landed(bucket_id)``: whether the copy
    has landed (the session's pushes provide all three)."""

    def __init__(
        self,
        buckets: Sequence[BucketSpec],
        *,
        stage: Callable[[int, Sequence[torch.Tensor | None]], bool],
        push: Callable[[int, Sequence[torch.Tensor | None], Sequence[AdamWHyper]], None],
        landed: Callable[[int], bool],
    ) -> None:
        self._buckets = buckets
        self._stage = stage
        self._push = push
        self._landed = landed
        self._unsent: collections.deque[tuple[int, _SegmentGrads, Sequence[AdamWHyper]]] = collections.deque()

    def __len__(self) -> int:
        return len(self._unsent)

    def push(self, bucket_id: int, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> None:
        """Start the bucket's copy out of the device and send it once it has landed; a bucket the
        pushes do not stage (small, with a parameter that has no gradient, or already on its node)
        is pushed now."""
        bucket = self._buckets[bucket_id]
        if not self._stage(bucket_id, grads):
            self._push(bucket_id, grads, hypers)
            return
        self._unsent.append((bucket_id, _SegmentGrads({seg.param_index: grads[seg.param_index] for seg in bucket.segments}), hypers))

    def send_landed(self) -> None:
        """Send the staged buckets whose copies have landed, in order, stopping at the first that has not."""
        while self._unsent and self._landed(self._unsent[0][0]):
            self._send_first()

    def send_all(self) -> None:
        """Send every staged bucket, waiting for each copy to land (the end of a step)."""
        while self._unsent:
            self._send_first()

    def _send_first(self) -> None:
        bucket_id, grads, hypers = self._unsent[0]
        self._push(bucket_id, grads, hypers)
        self._unsent.popleft()  # only once sent: a push that failed stays for the step's retry, with its gradients
