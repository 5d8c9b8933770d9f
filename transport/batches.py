"""Several buckets in one message: what keeps a bucket cheap when buckets are small.

A PUSH or PARAMS whose ``meta["batch"]`` lists buckets carries their payloads back to back, in the
listed order; the receiver cuts it into one message per bucket (views over the received frames, no
copy) and handles each as if it had come alone. Sender and receiver agree on it at HELLO (the worker
asks, the node's HELLO_OK says yes), and only one connection per node uses it: over several lanes a
batch would travel on one lane while its buckets' other messages take theirs.

Entries: a PUSH lists ``[bucket_id, numel]`` in ascending bucket order (the header's step, rank and
``hyper`` hold for all; a node takes all of them or none, see the daemon);
a PARAMS lists ``[bucket_id, step, numel, meta]`` (``meta`` as a single PARAMS would carry).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from transport.interface import Message
from transport.wire import ErrorCode, Header, MsgType, WireError

BATCH_BYTES = 1 << 20
"""A sender closes a batch once its payload reaches this; only buckets smaller than it are batched, so
no batch reaches twice this (what a node accepts besides its largest bucket)."""

MAX_BATCH_BYTES = 2 * BATCH_BYTES
"""The largest batch payload a sender makes."""

MAX_BATCH_ENTRIES = 4096
"""Buckets in one batch at most (a header lists each)."""

COALESCE_BELOW = 64 << 10
"""A batch whose buckets are all smaller than this leaves as one frame they are copied into: a frame
of its own costs a bucket more (a send call, a view on each side) than copying it, and ZeroMQ copies
frames this small anyway."""


def _is_int(value: object) -> bool:
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


def _bad_entry(entry: object, params: bool) -> str:
    return f"a batch entry is [bucket_id, {'step, numel, meta' if params else 'numel'}], got {entry!r}"[:300]


def slice_views(tensors: Sequence[tuple[int, torch.Tensor]], start: int, numel: int, first: int = 0) -> tuple[list[tuple[int, torch.Tensor]], int]:
    """The ``(offset, view)`` pairs of elements ``[start, start + numel)`` of a payload received as
    ``tensors`` (in offset order), offsets counted from ``start``: views, no copy. The search starts at
    ``tensors[first]``; also returns where the next range's search may start (the frame the range ends
    in), so cutting a payload into consecutive ranges reads each frame once or twice, not once per range."""
    end = start + numel
    parts = []
    index = first
    while index < len(tensors):
        offset, view = tensors[index]
        stop = offset + view.numel()
        if offset >= end:
            break
        low, high = max(offset, start), min(stop, end)
        if low < high:
            parts.append((low - start, view[low - offset : high - offset]))
        if stop > end:
            break
        index += 1
    return parts, index


def split_batch(message: Message) -> list[Message]:
    """One message per bucket of a batched PUSH or PARAMS; ``WireError`` for a malformed batch."""
    header = message.header
    entries = header.meta.get("batch")
    params = header.msg_type == MsgType.PARAMS
    width = 4 if params else 2
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_BATCH_ENTRIES:
        raise WireError(ErrorCode.BAD_REQUEST, f"batch must list 1 to {MAX_BATCH_ENTRIES} buckets", peer=message.peer)
    parts = []
    start = 0
    frame = 0
    previous_id = -1
    tensors = message.tensors
    whole = tensors[0][1] if len(tensors) == 1 and tensors[0][0] == 0 and tensors[0][1].numel() == header.numel else None
    push_meta = None if params else {"hyper": header.meta.get("hyper")}
    for entry in entries:
        # once a bucket, on both sides of every small-bucket step: the entry unpacked and its integers
        # checked by type first (msgpack makes plain ints), without a generator per entry
        if not isinstance(entry, list) or len(entry) != width:
            raise WireError(ErrorCode.BAD_REQUEST, _bad_entry(entry, params))
        if params:
            bucket_id, step, numel, meta = entry
            if not (_is_int(bucket_id) and _is_int(step) and _is_int(numel)):
                raise WireError(ErrorCode.BAD_REQUEST, _bad_entry(entry, params))
            if not isinstance(meta, dict):
                raise WireError(ErrorCode.BAD_REQUEST, "a PARAMS batch entry's meta must be a map")
        else:
            bucket_id, numel = entry
            if not (_is_int(bucket_id) and _is_int(numel)):
                raise WireError(ErrorCode.BAD_REQUEST, _bad_entry(entry, params))
            step, meta = header.step, dict(push_meta)  # type: ignore[arg-type]
            if bucket_id <= previous_id:  # so no bucket comes twice
                raise WireError(ErrorCode.BAD_REQUEST, "a PUSH batch lists its buckets in ascending order")
            previous_id = bucket_id
        if numel < 0 or start + numel > header.numel:
            raise WireError(ErrorCode.BAD_REQUEST, f"batch entries hold more than the {header.numel} elements the header declares")
        part = Header(
            msg_type=header.msg_type,
            rank=header.rank,
            step=step,
            bucket_id=bucket_id,
            dtype=header.dtype if numel else "",
            numel=numel,
            meta=meta,
        )
        if whole is not None:  # the batch in one frame (small buckets are coalesced): a slice of it
            views = [(0, whole[start : start + numel])] if numel else []
        else:
            views, frame = slice_views(message.tensors, start, numel, frame)
        parts.append(Message(peer=message.peer, header=part, tensors=views, user_id=message.user_id))
        start += numel
    if start != header.numel:
        raise WireError(ErrorCode.BAD_REQUEST, f"batch entries hold {start} elements, the header declares {header.numel}")
    return parts
