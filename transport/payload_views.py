"""A received payload's frames, checked against the header that declared them and viewed as tensors
in place (:func:`payload_views`), or a payload that lies whole on a node's parameter board
(:func:`board_payload_views`). Every check raises :class:`~transport.wire.WireError`: a peer's bad
declaration is its error, never the receiver's."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from transport.wire import WIRE_DTYPES, ErrorCode, Header, WireError


def _checked_size(header: Header, arrived: int, max_bytes: int, peer: bytes | None) -> int:
    """The payload's declared bytes, once they are within ``max_bytes`` and what ``arrived``."""
    expected = header.payload_bytes
    if expected > max_bytes:
        raise WireError(ErrorCode.TOO_LARGE, f"payload of {expected} bytes is over the limit of {max_bytes}", peer=peer)
    if arrived != expected:
        raise WireError(
            ErrorCode.BAD_PAYLOAD,
            f"header declares {header.numel} x {header.dtype} = {expected} bytes, {arrived} bytes arrived",
            peer=peer,
        )
    return expected


def payload_views(header: Header, chunks: Sequence[memoryview], *, max_bytes: int, peer: bytes | None = None) -> list[tuple[int, torch.Tensor]]:
    """Validate the chunk frames against the header and view them as tensors.

    Returns ``(element_offset, tensor)`` pairs, zero-copy over the received buffers. Raises
    :class:`WireError` when the size is over ``max_bytes`` or the bytes do not match the declaration.
    """
    if len(chunks) != header.num_chunks:
        raise WireError(ErrorCode.BAD_PAYLOAD, f"header declares {header.num_chunks} chunks, {len(chunks)} arrived", peer=peer)
    if _checked_size(header, sum(len(chunk) for chunk in chunks), max_bytes, peer) == 0:
        return []
    dtype = WIRE_DTYPES[header.dtype]
    itemsize = dtype.itemsize
    views = []
    offset = 0
    for chunk in chunks:
        if len(chunk) % itemsize:
            raise WireError(ErrorCode.BAD_PAYLOAD, f"chunk of {len(chunk)} bytes splits a {header.dtype} element", peer=peer)
        if len(chunk):
            # Receivers may accumulate into what arrived; a read-only buffer (a small frame the
            # transport copied into bytes) is copied once more so every view is writable.
            writable = chunk if not chunk.readonly else memoryview(bytearray(chunk))
            views.append((offset, torch.frombuffer(writable, dtype=dtype)))
        offset += len(chunk) // itemsize
    return views


def board_payload_views(header: Header, payload: memoryview, *, max_bytes: int, peer: bytes | None = None) -> list[tuple[int, torch.Tensor]]:
    """A payload that lies whole in one read-only buffer (its slot on a node's parameter board), as
    one view over it, read in place and only read: a receiver may view a stretch that crosses the
    chunks the message was cut in (a worker computing from the board), and copies the payload out in
    one piece (on a GPU, one host-to-device copy a bucket). ``WireError`` as :func:`payload_views`.
    torch's warning about a read-only buffer comes once per process, and the board's own mapping
    (SharedWindow) took it, silenced."""
    if _checked_size(header, len(payload), max_bytes, peer) == 0:
        return []
    return [(0, torch.frombuffer(payload, dtype=WIRE_DTYPES[header.dtype]))]
