"""A bucket's optimizer state out and in, part by part, for ``RemoteAdamW.state_dict()`` and
``load_state_dict()``: the master parameters, the two moments and each segment's AdamW step count.

Moving a run between torch (or DeepSpeed) and netoptim needs the moments as well as the parameters;
they travel as fp32, whatever the job's wire dtype, so nothing is rounded on the way.
"""

from __future__ import annotations

import math

import torch

from optimizer_node.storage import BucketState, BucketStore
from transport.interface import Message
from transport.wire import ErrorCode, WireError

PARTS = ("param", "exp_avg", "exp_avg_sq")


def _part(meta: dict) -> str:
    part = meta.get("part")
    if part not in PARTS:
        raise WireError(ErrorCode.BAD_REQUEST, f"part must be one of {', '.join(PARTS)}, got {part!r}")
    return part


def read_part(store: BucketStore, state: BucketState, meta: dict, segments: int) -> tuple[torch.Tensor, dict]:
    """A copy of one part of the bucket's state (fp32) and the reply's meta (part, segment steps)."""
    part = _part(meta)
    store.acquire(state)
    try:
        values = getattr(state, part).clone()
    finally:
        store.release(state, dirty=False)
    return values, {"part": part, "segment_steps": state.segment_step_counts(segments)}


def load_part(store: BucketStore, state: BucketState, message: Message, segments: int) -> None:
    """Replace one part of the bucket's state with the message's fp32 values and, when given, every
    segment's step count; ``WireError`` (nothing changed) for a bad part or step list."""
    part = _part(message.header.meta)
    steps = message.header.meta.get("segment_steps")
    if steps is not None:
        if not (isinstance(steps, list) and len(steps) == segments):
            raise WireError(ErrorCode.BAD_REQUEST, f"segment_steps must list the bucket's {segments} segments")
        if not all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s >= 0 and s == int(s) for s in steps):
            raise WireError(ErrorCode.BAD_REQUEST, f"segment_steps must be non-negative whole numbers, got {steps}")
    store.acquire(state)
    try:
        target = getattr(state, part)
        for offset, view in message.tensors:
            target[offset : offset + view.numel()].copy_(view)
        if part == "param":
            state.wire_step = -1  # the cast copy no longer holds these values
            state.new_revision()  # nor does the parameter board
        if steps is not None:
            state.set_segment_step_counts([float(s) for s in steps])
    finally:
        store.release(state, dirty=True)
