"""A layer-wise worker's pushes, sent as their copies out of the device land rather than waited for.

Layer-wise backward pushes each unit's gradients from its hook. Waiting there for the copies out of
the device would hold the thread that launches the rest of backward (autograd's device thread, on a
GPU) until the GPU has drained: the GPU would idle through every unit's copies. Here the hook starts
the copies (:meth:`~gpu_worker.session.OffloadSession.stage_bucket`, on a side stream) and returns;
each bucket goes out, in order, at the first hook that finds its copy landed, and the step's end
sends whatever is left, waiting for it. Pushes keep their pacing: a push that finds the push window
full waits for room where it is sent, as before. On the CPU a copy has landed once made, so each
bucket goes out at once, as it did.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch

from gpu_worker.session import OffloadSession
from netoptim.job.hyper import AdamWHyper


class _SegmentGrads:
    """The gradients of one bucket's parameters as they were when it was staged (the unit's ``grad``
    attributes are cleared right after: its copies hold the memory until they have read it)."""

    __slots__ = ("_grads",)

    def __init__(self, grads: dict[int, torch.Tensor | None]) -> None:
        self._grads = grads

    def __getitem__(self, param_index: int) -> torch.Tensor | None:
        return self._grads.get(param_index)


class LandedPushes:
    """Buckets staged for a push, sent in order once their copies out of the device have landed."""

    def __init__(self, session: OffloadSession) -> None:
        self._session = session
        self._unsent: collections.deque[tuple[int, _SegmentGrads, Sequence[AdamWHyper]]] = collections.deque()

    def __len__(self) -> int:
        return len(self._unsent)

    def push(self, bucket_id: int, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> None:
        """Start the bucket's copy out of the device and send it once it has landed; a bucket the
        session does not stage (small, with a parameter that has no gradient, or already on its node)
        is pushed now."""
        session = self._session
        bucket = session.buckets[bucket_id]
        if not session.stage_bucket(bucket_id, grads):
            session.push_bucket(bucket_id, grads, hypers)
            return
        self._unsent.append((bucket_id, _SegmentGrads({seg.param_index: grads[seg.param_index] for seg in bucket.segments}), hypers))

    def send_landed(self) -> None:
        """Send the staged buckets whose copies have landed, in order, stopping at the first that has not."""
        while self._unsent and self._session.staged_landed(self._unsent[0][0]):
            self._send_first()

    def send_all(self) -> None:
        """Send every staged bucket, waiting for each copy to land (the end of a step)."""
        while self._unsent:
            self._send_first()

    def _send_first(self) -> None:
        bucket_id, grads, hypers = self._unsent[0]
        self._session.push_bucket(bucket_id, grads, hypers)
        self._unsent.popleft()  # only once sent: a push that failed stays for the step's retry, with its gradients
