"""A bucket's optimizer state out and in, part by part, for ``RemoteAdamW.state_dict()`` and
``load_state_dict()``: the master parameters, the two moments and each segment's AdamW step count.

Moving a run between torch (or DeepSpeed) and netoptim needs the moments as well as the parameters;
they travel as fp32, whatever the job's wire dtype, so nothing is rounded on the way. Moments a job
keeps compressed (:mod:`optimizer_node.moments`) are decoded to fp32 on the way out and rounded to
the job's format on the way in.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from optimizer_node.state.storage import BucketState, BucketStore
from transport.interface import Message
from transport.wire import ErrorCode, Header, MsgType, WireError, tensor_header

if TYPE_CHECKING:
    from optimizer_node.config import NodeConfig
    from optimizer_node.intake.admission import JobAdmission
    from optimizer_node.intake.rank_check import RankCheck
    from optimizer_node.job_state import ActiveJob, BucketStep
    from optimizer_node.serving.outgoing import Outgoing
    from optimizer_node.serving.replies import ParameterReplies

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
        values = state.param if part == "param" else state.moment(part)  # compressed moments: decoded into a new tensor
        if values is getattr(state, part):  # the state's own tensor: a copy, as it changes after the reply
            values = values.clone()
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
        if part == "param":
            state.own_param()  # not into the board's slot same-host workers may be reading
        target = state.param if part == "param" else state.moment(part)  # fp32 moments: the tensor itself
        for offset, view in message.tensors:
            target[offset : offset + view.numel()].copy_(view)
        if part != "param" and state.codec is not None:
            state.set_moment(part, target)  # rounded to the job's format, as the update would store it
        if part == "param":
            state.wire_step = -1  # the cast copy no longer holds these values
            state.new_revision()  # nor does the parameter board
        if steps is not None:
            state.set_segment_step_counts([float(s) for s in steps])
    finally:
        store.release(state, dirty=True)


class StateRequests:
    """One job's READ_STATE and LOAD_STATE messages: a rank reads a part of a bucket's state as it is
    now; rank 0 replaces one between steps. ``in_flight``: the job's steps in flight by bucket."""

    def __init__(
        self,
        config: NodeConfig,
        ranks: RankCheck,
        admission: JobAdmission,
        store: BucketStore,
        replies: ParameterReplies,
        outgoing: Outgoing,
        in_flight: dict[int, BucketStep],
    ) -> None:
        self._config = config
        self._ranks = ranks
        self._admission = admission
        self._store = store
        self._replies = replies
        self._outgoing = outgoing
        self._in_flight = in_flight

    def on_read_state(self, message: Message) -> None:
        """STATE: one part of a bucket's state as it is now (fp32), with its segments' step counts."""
        job, state = self._state_of(message)
        values, meta = read_part(self._store, state, message.header.meta, len(job.segments[state.bucket_id]))
        header = tensor_header(MsgType.STATE, values, self._config.chunk_bytes, step=state.step, bucket_id=state.bucket_id, meta=meta)
        self._outgoing.send(message.peer, header, values)

    def on_load_state(self, message: Message) -> None:
        """Rank 0 replaces one part of a bucket's state between steps (``load_state_dict``); ACK."""
        job, state = self._state_of(message)
        header = message.header
        if header.rank != 0:
            raise WireError(ErrorCode.BAD_REQUEST, "only rank 0 loads optimizer state")
        self._admission.check_payload(header, job.owned[state.bucket_id], "float32")
        in_flight = self._in_flight.get(state.bucket_id)
        if in_flight is not None and 0 in in_flight.reduction.received:
            raise WireError(ErrorCode.BAD_REQUEST, f"rank 0 already pushed bucket {state.bucket_id} for step {in_flight.step}: load state between steps")
        if self._replies.outbox.waits_for(state.bucket_id):  # values waiting in a batch are read from them too
            self._replies.flush()
        for handle in state.pending_sends:  # values on their way out are read from the tensors replaced here
            handle.wait(self._config.send_timeout_s)
        state.pending_sends.clear()
        load_part(self._store, state, message, len(job.segments[state.bucket_id]))
        self._outgoing.send(message.peer, Header(msg_type=MsgType.ACK, bucket_id=state.bucket_id, step=state.step))

    def _state_of(self, message: Message) -> tuple[ActiveJob, BucketState]:
        job = self._ranks.require_rank(message)
        bucket = self._admission.owned_bucket(job, message.header)
        state = self._store.get(bucket.bucket_id)
        if state is None:
            raise WireError(ErrorCode.NOT_REGISTERED, f"bucket {bucket.bucket_id} has no initial values yet")
        return job, state
