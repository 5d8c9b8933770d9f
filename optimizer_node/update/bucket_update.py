"""Which update one bucket gets at one step, as ``torch.optim.AdamW`` + DDP would give its parameters.

A worker's PUSH names the bucket's segments whose parameter had no gradient on that rank (``grad``
None: an unused head, an expert no token chose, a frozen layer). As with DDP, such a parameter counts
as zeros from that rank; a parameter with no gradient on *every* rank is not stepped at all, as
torch's optimizers skip a parameter whose ``grad`` is None: its values, moments and step count stay.
So each segment may come to have a step count of its own; a bucket keeps one count for all its
segments (the fast path) until they differ, and goes back to one count when they agree again.

A push with no gradient for any of the bucket's segments carries no payload at all: frozen layers
cost no gradient bytes on the wire, and when every rank's push is empty the workers get no values
back either (``unchanged``), since nothing changed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from optimizer_node.state.storage import BucketState
from optimizer_node.update.bucket_pass import move_for_update_in_place, reduce_and_update, reduce_and_update_segments
from optimizer_node.update.moment_pass import update_compressed
from optimizer_node.update.reduce import OrderedReduction
from protos.job.hyper import AdamWHyper
from protos.job.placement import BucketSpec
from transport.wire import ErrorCode, WireError

_NONE_ABSENT: frozenset[int] = frozenset()


class Applied(NamedTuple):
    """What :func:`update_bucket` did."""

    changed: bool  # False: no segment had a gradient on any rank
    compiled: bool  # the compiled loop did the update (else torch ops, or nothing)


def absent_segments(meta: dict, bucket: BucketSpec, numel: int) -> frozenset[int]:
    """The segments a PUSH says it has no gradient for (``meta["absent"]``: ascending segment
    indices); ``WireError`` for a malformed list, or for a push without payload that does not name
    every segment."""
    raw = meta.get("absent")
    count = len(bucket.segments)
    if raw is None:  # the common case: a gradient for every segment
        if numel == 0:
            raise WireError(ErrorCode.WRONG_SHAPE, f"a push without payload must name all {count} segments of bucket {bucket.bucket_id} as absent")
        return _NONE_ABSENT
    if not isinstance(raw, list) or len(raw) > count or not all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
        raise WireError(ErrorCode.BAD_REQUEST, f"absent must be a list of at most {count} segment indices of bucket {bucket.bucket_id}")
    if any(not 0 <= i < count for i in raw) or any(a >= b for a, b in itertools.pairwise(raw)):
        raise WireError(ErrorCode.BAD_REQUEST, f"absent must hold ascending segment indices below {count} (bucket {bucket.bucket_id}), got {raw}")
    absent = frozenset(raw)
    if numel == 0 and len(absent) != count:
        raise WireError(ErrorCode.WRONG_SHAPE, f"a push without payload must name all {count} segments of bucket {bucket.bucket_id} as absent")
    return absent


def update_bucket(
    state: BucketState,
    reduction: OrderedReduction,
    hyper: AdamWHyper,
    *,
    segments: Sequence[tuple[int, int]],
    absent_everywhere: frozenset[int],
    rule: str = "adamw",
    grad_divisor: torch.Tensor | None,
    grad_multiplier: torch.Tensor | None,
    wire_out: torch.Tensor | None,
    previous_out: torch.Tensor | None,
    compiled: bool,
    param_out: torch.Tensor | None = None,
) -> Applied:
    """Apply the step's update (``rule``, see :mod:`optimizer_node.update.rules`) to ``state``; nothing
    changes where no segment had a gradient on any rank, the received frames are let go of and the
    outputs filled all the same. Rules other than AdamW take the per-segment pass; ``compiled``
    allows the compiled loop where it takes the update (compressed moments take theirs regardless:
    :func:`~optimizer_node.update.moment_pass.update_compressed`). ``param_out`` (fp32, no ``wire_out``): the
    new parameters go there and ``state.param`` is only read; the caller makes it the bucket's
    ``param`` (its master values on the parameter board's other slot)."""
    stepped = [index not in absent_everywhere for index in range(len(segments))]
    if any(stepped) and state.codec is not None:  # compressed moments: a pass of their own
        ran_compiled = update_compressed(
            state,
            reduction,
            hyper,
            stepped=stepped,
            rule=rule,
            grad_divisor=grad_divisor,
            grad_multiplier=grad_multiplier,
            wire_out=wire_out,
            previous_out=previous_out,
            param_out=param_out,
        )
        return Applied(changed=True, compiled=ran_compiled)
    if not any(stepped):
        reduction.take_pending()
        if previous_out is not None:
            previous_out.copy_(state.param)
        for out in (wire_out, param_out):
            if out is not None and out.data_ptr() != state.param.data_ptr():
                out.copy_(state.param)
        return Applied(changed=False, compiled=False)
    if rule == "adamw" and state.segment_steps is None and all(stepped):  # the common case: one step count, the fast pass
        ran_compiled = reduce_and_update(
            reduction,
            state.param,
            state.exp_avg,
            state.exp_avg_sq,
            state.step_tensor,
            hyper,
            segments=segments,
            grad_divisor=grad_divisor,
            grad_multiplier=grad_multiplier,
            wire_out=wire_out,
            previous_out=previous_out,
            compiled=compiled,
            arrays=state.numpy_state() if compiled else None,
            param_out=param_out,
        )
        return Applied(changed=True, compiled=ran_compiled)
    steps = [torch.tensor(count, dtype=torch.float32) for count in state.segment_step_counts(len(segments))]
    param = state.param
    if param_out is not None:  # the per-segment pass updates in place: there, from the values read
        param, previous_out = move_for_update_in_place(param, param_out, previous_out)
    reduce_and_update_segments(
        reduction,
        param,
        state.exp_avg,
        state.exp_avg_sq,
        steps,
        hyper,
        segments=segments,
        stepped=stepped,
        rule=rule,
        grad_divisor=grad_divisor,
        grad_multiplier=grad_multiplier,
        wire_out=wire_out,
        previous_out=previous_out,
    )
    state.set_segment_step_counts([float(step) for step in steps])
    return Applied(changed=True, compiled=False)
