"""The outbox's batches of small buckets leave as one frame they are copied into: the receiver cuts
out every bucket's values as they were when the batch was taken, and the frame is reused only once
its send is done."""

from __future__ import annotations

import torch

from optimizer_node.serving.params_outbox import ParamsOutbox
from optimizer_node.state.storage import BucketState
from transport.batches import COALESCE_BELOW, split_batch
from transport.interface import Message, SendHandle
from transport.payload_views import payload_views


class Send(SendHandle):
    """A send whose completion the test decides (what the transport reports for a zero-copy frame)."""

    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def wait(self, timeout_s: float) -> None:
        self.finished = True


def _state(bucket_id: int, numel: int) -> BucketState:
    values = torch.arange(numel, dtype=torch.float32) + 1000 * bucket_id
    return BucketState(bucket_id, values, torch.zeros(numel), torch.zeros(numel), torch.zeros(()), step=3)


def _received(header, payload) -> list[Message]:
    frames = [memoryview(torch.cat(payload).numpy()).cast("B")]  # as the peer gets them: one frame
    return split_batch(Message(peer=b"w", header=header, tensors=payload_views(header, frames, max_bytes=8 << 20)))


def test_small_buckets_leave_as_one_copied_frame_reused_after_its_send():
    outbox = ParamsOutbox()
    states = [_state(i, 1000 + i) for i in range(5)]
    for state in states:
        outbox.add(b"w", state, {}, state.param)
    header, payload, reading = outbox.take(b"w", 4 << 20)
    assert len(payload) == 1 and reading == [], "one frame, and no bucket is read by the send"
    expected = [state.param.clone() for state in states]
    for state in states:
        state.param.add_(1.0)  # the next update: the values sent must not change
    parts = _received(header, payload)
    assert [part.header.bucket_id for part in parts] == list(range(5)) and all(part.header.step == 3 for part in parts)
    assert all(torch.equal(part.tensors[0][1], values) for part, values in zip(parts, expected, strict=True))

    first = Send()
    outbox.sent(first)
    for state in states:
        outbox.add(b"w", state, {}, state.param)
    _, second_payload, _ = outbox.take(b"w", 4 << 20)
    assert second_payload[0].data_ptr() != payload[0].data_ptr(), "the first frame is still being sent"
    outbox.sent(Send())
    first.finished = True
    for state in states:
        outbox.add(b"w", state, {}, state.param)
    _, third_payload, _ = outbox.take(b"w", 4 << 20)
    assert third_payload[0].data_ptr() == payload[0].data_ptr(), "reused once its send was done"


def test_buckets_that_are_not_small_leave_zero_copy():
    outbox = ParamsOutbox()
    numel = COALESCE_BELOW // 4
    states = [_state(i, numel) for i in range(2)]
    for state in states:
        outbox.add(b"w", state, {}, state.param)
    _, payload, reading = outbox.take(b"w", 4 << 20)
    assert [p.data_ptr() for p in payload] == [s.param.data_ptr() for s in states] and reading == states
