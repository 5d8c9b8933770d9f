from __future__ import annotations

import msgpack
import pytest
import torch

from transport.payload_views import board_payload_views, payload_views
from transport.wire import (
    PROTOCOL_VERSION,
    ErrorCode,
    Header,
    MsgType,
    WireError,
    chunk_tensor,
    decode_header,
    dtype_name,
    encode_header,
    encode_message,
    tensor_header,
)


def test_header_round_trip():
    header = Header(msg_type=MsgType.PUSH, rank=3, step=17, bucket_id=5, dtype="bfloat16", numel=10, num_chunks=1, meta={"hyper": [1e-3, 0.9]})
    assert decode_header(encode_header(header)) == header


@pytest.mark.parametrize(
    ("raw", "code", "words"),
    [
        (b"\xc1garbage", ErrorCode.MALFORMED, "msgpack"),
        (msgpack.packb([1, 2, 3]), ErrorCode.MALFORMED, "not a map"),
        (msgpack.packb({"t": 5}), ErrorCode.VERSION, "None"),
        (msgpack.packb({"v": PROTOCOL_VERSION + 1, "t": 5}), ErrorCode.VERSION, f"speaks {PROTOCOL_VERSION}"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "t": 99}), ErrorCode.MALFORMED, "unknown message type"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "t": 5, "r": True}), ErrorCode.MALFORMED, "rank"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "t": 5, "n": -1}), ErrorCode.MALFORMED, "negative"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "t": 5, "n": 4, "d": "int64"}), ErrorCode.WRONG_DTYPE, "int64"),
    ],
)
def test_bad_headers_raise_typed_errors(raw, code, words):
    with pytest.raises(WireError) as info:
        decode_header(raw, peer=b"peer")
    assert info.value.code == code and words in info.value.message and info.value.peer == b"peer"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_chunks_are_zero_copy_views_and_reassemble(dtype):
    flat = torch.randn(1000).to(dtype)
    header = tensor_header(MsgType.PARAMS, flat, chunk_bytes=256)
    frames = encode_message(header, flat, chunk_bytes=256)
    assert header.num_chunks == len(frames) - 1 == -(-1000 * flat.element_size() // 256)
    flat[0] = 42  # the frames see the change: no copy was made
    views = payload_views(decode_header(frames[0]), frames[1:], max_bytes=1 << 20)
    rebuilt = torch.cat([view for _, view in views])
    assert torch.equal(rebuilt, flat) and [offset for offset, _ in views] == list(range(0, 1000, 256 // flat.element_size()))


def test_a_board_payload_is_one_view_of_its_slot():
    """A payload that lies whole in one buffer (its slot on a node's parameter board) is one view of
    it, however many chunks the message was cut in: a receiver copies it out in one piece, and a
    stretch may cross the chunks; a buffer of another size, or over the limit, is refused."""
    flat = torch.randn(1000)
    header = tensor_header(MsgType.PARAMS, flat, chunk_bytes=256)
    whole = memoryview(flat.numpy()).cast("B")
    chunks = [whole[start : start + 256] for start in range(0, len(whole), 256)]
    views = board_payload_views(header, whole, max_bytes=1 << 20)
    assert header.num_chunks == len(chunks) > 1 and len(views) == 1 and views[0][0] == 0
    assert torch.equal(views[0][1], flat) and views[0][1].data_ptr() == flat.data_ptr()  # no copy
    short = whole[:-4]  # not the payload's buffer
    with pytest.raises(WireError, match="4000 bytes, 3996 bytes arrived"):
        board_payload_views(header, short, max_bytes=1 << 20)
    with pytest.raises(WireError, match="over the limit"):
        board_payload_views(header, whole, max_bytes=100)


def test_payload_validation():
    flat = torch.ones(64)
    header = tensor_header(MsgType.PUSH, flat)
    chunk = flat.numpy().tobytes()
    with pytest.raises(WireError, match="256 bytes, 255 bytes arrived"):
        payload_views(header, [memoryview(chunk[:-1])], max_bytes=1 << 20)
    with pytest.raises(WireError, match="1 chunks, 2 arrived"):
        payload_views(header, [memoryview(chunk), memoryview(b"")], max_bytes=1 << 20)
    with pytest.raises(WireError, match="over the limit"):
        payload_views(header, [memoryview(chunk)], max_bytes=100)
    split = Header(msg_type=MsgType.PUSH, dtype="float32", numel=64, num_chunks=2)
    with pytest.raises(WireError, match="splits a float32 element"):
        payload_views(split, [memoryview(chunk[:2]), memoryview(chunk[2:])], max_bytes=1 << 20)


def test_only_wire_dtypes_and_flat_cpu_tensors():
    with pytest.raises(TypeError, match="cannot travel"):
        dtype_name(torch.int64)
    with pytest.raises(ValueError, match="1-D"):
        chunk_tensor(torch.ones(2, 2))
    with pytest.raises(ValueError, match="one dtype"):
        tensor_header(MsgType.PUSH, [torch.ones(2), torch.ones(2, dtype=torch.float16)])
