"""Cutting a batched message into one message per bucket (transport.batches): views over the frames
as they arrived, whatever their boundaries, and a clear error for every malformed batch."""

from __future__ import annotations

import pytest
import torch

from transport.batches import MAX_BATCH_ENTRIES, slice_views, split_batch
from transport.interface import Message
from transport.wire import ErrorCode, MsgType, WireError, tensor_header


def frames(values: torch.Tensor, sizes: list[int]) -> list[tuple[int, torch.Tensor]]:
    """``values`` as received in frames of ``sizes`` elements: (offset, view) pairs."""
    out, offset = [], 0
    for size in sizes:
        out.append((offset, values[offset : offset + size]))
        offset += size
    return out


def test_consecutive_ranges_pick_up_where_the_last_one_ended():
    values = torch.arange(10.0)
    received = frames(values, [3, 3, 4])
    first, resume = 0, 0
    for start, numel in [(0, 2), (2, 2), (4, 0), (4, 5), (9, 1)]:
        parts, resume = slice_views(received, start, numel, resume)
        assert torch.equal(torch.cat([v for _, v in parts]) if parts else torch.empty(0), values[start : start + numel])
        assert resume >= first
        first = resume


@pytest.mark.parametrize("sizes", [[10], [3, 7], [1, 1, 1, 1, 1, 5], [4, 6]])
def test_slices_span_frames_without_copies(sizes):
    values = torch.arange(10.0)
    for start, numel in [(0, 10), (2, 5), (3, 1), (9, 1), (0, 0)]:
        parts, _next = slice_views(frames(values, sizes), start, numel)
        assert sum(view.numel() for _, view in parts) == numel
        rebuilt = torch.cat([view for _, view in parts]) if parts else torch.empty(0)
        assert torch.equal(rebuilt, values[start : start + numel])
        assert [offset for offset, _ in parts] == sorted(offset for offset, _ in parts) and (not parts or parts[0][0] == 0)
        for _, view in parts:
            assert view.untyped_storage().data_ptr() == values.untyped_storage().data_ptr()


def test_a_push_batch_becomes_pushes_that_share_its_step_rank_and_hyperparameters():
    values = torch.arange(12.0)
    header = tensor_header(MsgType.PUSH, values, rank=3, step=7, bucket_id=2, meta={"hyper": [1e-3, 0.9, 0.999, 1e-8, 0.0], "batch": [[2, 5], [4, 7]]})
    parts = split_batch(Message(peer=b"p", header=header, tensors=frames(values, [6, 6]), user_id="key"))
    assert [(p.header.bucket_id, p.header.numel, p.header.step, p.header.rank) for p in parts] == [(2, 5, 7, 3), (4, 7, 7, 3)]
    assert all(p.header.meta == {"hyper": [1e-3, 0.9, 0.999, 1e-8, 0.0]} and p.peer == b"p" and p.user_id == "key" for p in parts)
    assert torch.equal(torch.cat([v for _, v in parts[1].tensors]), values[5:])


def test_a_params_batch_carries_each_buckets_step_and_meta():
    entries = [[0, 4, 6, {}], [3, 4, 0, {"unchanged": True}], [1, 5, 6, {"grad_norm": 1.5}]]
    values = torch.arange(12.0)
    header = tensor_header(MsgType.PARAMS, values, bucket_id=0, step=4, meta={"batch": entries})
    parts = split_batch(Message(peer=b"", header=header, tensors=frames(values, [12])))
    assert [(p.header.bucket_id, p.header.step, p.header.numel, p.header.meta) for p in parts] == [
        (0, 4, 6, {}),
        (3, 4, 0, {"unchanged": True}),
        (1, 5, 6, {"grad_norm": 1.5}),
    ]
    assert parts[1].tensors == [] and parts[1].header.dtype == ""


MALFORMED = [
    ("not a list", MsgType.PUSH, 4, {"0": 4}, "must list"),
    ("empty", MsgType.PUSH, 4, [], "must list"),
    ("too many", MsgType.PUSH, MAX_BATCH_ENTRIES + 1, [[i, 1] for i in range(MAX_BATCH_ENTRIES + 1)], "must list"),
    ("an entry that is not a list", MsgType.PUSH, 4, [4], "[bucket_id, numel]"),
    ("a float", MsgType.PUSH, 4, [[0, 4.0]], "[bucket_id, numel]"),
    ("a bool", MsgType.PUSH, 1, [[0, True]], "[bucket_id, numel]"),
    ("a negative size", MsgType.PUSH, 4, [[0, 5], [1, -1]], "more than"),
    ("short of the payload", MsgType.PUSH, 4, [[0, 3]], "header declares 4"),
    ("past the payload", MsgType.PUSH, 4, [[0, 3], [1, 3]], "more than the 4"),
    ("the same bucket twice", MsgType.PUSH, 4, [[1, 2], [1, 2]], "ascending"),
    ("PARAMS entry without meta", MsgType.PARAMS, 4, [[0, 1, 4]], "[bucket_id, step, numel, meta]"),
    ("PARAMS meta not a map", MsgType.PARAMS, 4, [[0, 1, 4, []]], "meta must be a map"),
]


@pytest.mark.parametrize(("what", "kind", "numel", "entries", "words"), MALFORMED, ids=[case[0] for case in MALFORMED])
def test_malformed_batches_are_refused(what, kind, numel, entries, words):
    values = torch.zeros(numel)
    header = tensor_header(kind, values, meta={"batch": entries})
    with pytest.raises(WireError) as caught:
        split_batch(Message(peer=b"", header=header, tensors=frames(values, [numel])))
    assert caught.value.code == ErrorCode.BAD_REQUEST
    assert words in caught.value.message
