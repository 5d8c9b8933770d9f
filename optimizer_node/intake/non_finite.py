"""Non-finite gradients (NaN, inf): how a node finds them in a push, and what it did about them.

A node checks every gradient it receives before the gradient touches any state, at the cost of one
read of memory the transport has just written. Where the node's compiled loop is in use, the check
counts the elements whose exponent bits are all ones, on the loop's own threads
(:func:`optimizer_node.update.kernels.compiled_update.count_non_finite`). Otherwise it is one ``torch.sum`` per
received view: a sum is finite only if every element is (NaN propagates, and an inf turns the sum
into inf or NaN), so a finite sum proves the view clean; only a sum that is not finite (a NaN or
inf, or finite values whose sum overflows) is looked at element by element, which also counts the
culprits. Either way a finite gradient whose sum would overflow is accepted, as torch would apply it.

Where a worker vouches for its gradient (a GPU worker sums each bucket on the device before copying
it out, and a finite sum proves every element finite: header ``meta["finite"]``), the node takes its
word and reads nothing (``--non-finite-check worker``, the default); a push without it, from a CPU
worker or a worker whose sum was not finite, is checked here. ``--non-finite-check node`` checks
every push. A worker that vouches falsely can put NaN into the state; it could as well push finite
garbage: the check guards against accidents, not against a hostile rank (that is CURVE's job).

What follows depends on the node's ``--non-finite`` policy (:data:`POLICIES`):

* ``refuse`` (default): the push is answered with ``ERROR NON_FINITE`` naming the rank, bucket,
  step and the number of NaN/inf values; nothing of the bucket changes, the other ranks' gradients
  of it stay, and the rank may push that bucket again for the same step;
* ``skip``: the gradient is taken, and the whole step is skipped on every bucket of every node, as
  ``torch.cuda.amp.GradScaler`` skips ``optimizer.step()``: parameters, moments and AdamW's step
  count stay as they were and the workers get the unchanged parameters (the agreement is the
  global-norm round of :mod:`optimizer_node.update.clipping`).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import torch

from optimizer_node.update.kernels import compiled_update
from optimizer_node.update.reduce import TensorPieces

POLICIES = ("refuse", "skip")
"""What a node does with a non-finite gradient: refuse the push, or skip the step everywhere."""


_local = threading.local()


def _scratch() -> torch.Tensor:
    """This thread's fp32 scalar for the sums (the node checks on its one thread; tests on others)."""
    scratch = getattr(_local, "scratch", None)
    if scratch is None:
        scratch = _local.scratch = torch.empty((), dtype=torch.float32)
    return scratch


def count_non_finite(pieces: TensorPieces) -> int:
    """How many elements of a received gradient are NaN or +-inf (0 for a clean one).

    The compiled count where the node's compiled loop is in use; otherwise one vectorized sum per
    piece, and the exact count only for a piece whose sum is not finite.
    fp16 is summed in fp32: its own sum would overflow at 65504 and send ordinary gradients down
    the slow path. bf16 has fp32's range and is summed as it is (fp32 accumulation inside).
    """
    count = 0
    total = _scratch()
    for _offset, view in pieces:
        counted = compiled_update.count_non_finite(view)
        if counted is not None:
            count += counted
            continue
        torch.sum(view, dim=0, dtype=torch.float32, out=total)  # into a reused scalar: no allocation per push (views are flat)
        if not math.isfinite(float(total)):
            count += int(view.numel() - torch.count_nonzero(torch.isfinite(view)))
    return count


@dataclass(frozen=True, slots=True)
class NonFiniteEvent:
    """One non-finite gradient the node acted on. ``rank``/``bucket_id`` are -1 when the step was
    skipped because of a gradient another node saw."""

    action: str  # "refused" or "skipped"
    step: int
    rank: int
    bucket_id: int
    values: int  # NaN/inf elements in that rank's gradient of that bucket (0 when unknown here)
    unix_time: float


class NonFiniteStats:
    """Counters for status and metrics; written by the daemon thread, read by the admin and
    metrics threads (hence the lock)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self.refused_pushes = 0
        self.skipped_steps = 0
        self.vouched_pushes = 0
        self.last: NonFiniteEvent | None = None

    def refused(self, step: int, rank: int, bucket_id: int, values: int) -> None:
        with self._lock:
            self.refused_pushes += 1
            self.last = NonFiniteEvent("refused", step, rank, bucket_id, values, time.time())

    def vouched(self) -> None:
        """A push taken on its worker's word that it is finite (``--non-finite-check worker``)."""
        with self._lock:
            self.vouched_pushes += 1

    def skipped(self, step: int, rank: int, bucket_id: int, values: int) -> None:
        with self._lock:
            self.skipped_steps += 1
            self.last = NonFiniteEvent("skipped", step, rank, bucket_id, values, time.time())

    def snapshot(self) -> dict:
        """A plain dict (admin status, tests)."""
        with self._lock:
            last = self.last
            return {
                "policy": self.policy,
                "refused_pushes": self.refused_pushes,
                "skipped_steps": self.skipped_steps,
                "vouched_pushes": self.vouched_pushes,
                "last": None
                if last is None
                else {
                    "action": last.action,
                    "step": last.step,
                    "rank": last.rank,
                    "bucket_id": last.bucket_id,
                    "values": last.values,
                    "unix_time": last.unix_time,
                },
            }
