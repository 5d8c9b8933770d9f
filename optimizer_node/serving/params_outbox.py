"""New values waiting to leave as one batched PARAMS per worker (see :mod:`transport.batches`).

The node updates the buckets that are ready one after another; rather than one message per bucket and
worker, the values of small buckets collect here and leave together once no update is ready (or a
batch is full, or something else is sent to that worker: messages to one peer keep their order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from optimizer_node.state.storage import BucketState
from transport.batches import BATCH_BYTES, COALESCE_BELOW, MAX_BATCH_ENTRIES
from transport.interface import SendHandle
from transport.send_buffers import SendBuffers
from transport.wire import Header, MsgType, tensor_header

_COALESCED_BYTES = BATCH_BYTES + COALESCE_BELOW
"""The most a batch of buckets under ``COALESCE_BELOW`` holds: it closes once it reaches ``BATCH_BYTES``."""


@dataclass(slots=True)
class _Batch:
    entries: list[list] = field(default_factory=list)  # [bucket_id, step, numel, meta]
    payload: list[torch.Tensor] = field(default_factory=list)
    states: list[BucketState] = field(default_factory=list)  # whose tensors the payload reads
    nbytes: int = 0


class ParamsOutbox:
    """Per worker connection, the PARAMS of small buckets not sent yet."""

    def __init__(self) -> None:
        self._batches: dict[bytes, _Batch] = {}
        self._buckets: dict[int, int] = {}  # bucket -> how many batches hold its values
        # Frames that batches of small buckets are copied into (one size per wire dtype), lent to their
        # send and reused once it is done; the last one taken waits for sent() to say by which send.
        self._frames: dict[torch.dtype, SendBuffers] = {}
        self._unsent: tuple[bytes, torch.Tensor, SendBuffers] | None = None

    def waits_for(self, bucket_id: int) -> bool:
        """Whether values of ``bucket_id`` wait here (they must leave before the bucket changes)."""
        return bucket_id in self._buckets

    def __bool__(self) -> bool:
        return bool(self._batches)

    def holds(self, peer: bytes) -> bool:
        """Whether values for ``peer`` wait here."""
        return peer in self._batches

    def peers(self) -> list[bytes]:
        return list(self._batches)

    @staticmethod
    def takes(payload: torch.Tensor | None) -> bool:
        """Whether values of this size go into a batch (larger ones leave alone, as they are)."""
        return payload is None or ParamsOutbox.takes_bytes(payload.numel() * payload.element_size())

    @staticmethod
    def takes_bytes(nbytes: int) -> bool:
        """:meth:`takes` for a payload of ``nbytes``."""
        return nbytes < BATCH_BYTES

    def add(self, peer: bytes, state: BucketState, meta: dict, payload: torch.Tensor | None) -> bool:
        """Queue ``state``'s values of its current step for ``peer``; True when the batch is full."""
        batch = self._batches.get(peer)
        if batch is None:
            batch = self._batches[peer] = _Batch()
        numel = 0 if payload is None else payload.numel()
        batch.entries.append([state.bucket_id, state.step, numel, meta])
        if payload is not None:
            self._buckets[state.bucket_id] = self._buckets.get(state.bucket_id, 0) + 1
            batch.payload.append(payload)
            batch.states.append(state)
            batch.nbytes += numel * payload.element_size()
        return batch.nbytes >= BATCH_BYTES or len(batch.entries) >= MAX_BATCH_ENTRIES

    def take(self, peer: bytes, chunk_bytes: int) -> tuple[Header, list[torch.Tensor] | None, list[BucketState]]:
        """The message that sends what waits for ``peer`` (a plain PARAMS for a single bucket), its
        payload, and the buckets whose values it reads until sent."""
        batch = self._batches.pop(peer)
        for state in batch.states:
            left = self._buckets.pop(state.bucket_id) - 1
            if left:
                self._buckets[state.bucket_id] = left
        if len(batch.entries) == 1:
            bucket_id, step, _numel, meta = batch.entries[0]
            if batch.payload:
                return tensor_header(MsgType.PARAMS, batch.payload[0], chunk_bytes, step=step, bucket_id=bucket_id, meta=meta), batch.payload, batch.states
            return Header(msg_type=MsgType.PARAMS, step=step, bucket_id=bucket_id, meta=meta), None, []
        first = batch.entries[0]
        meta = {"batch": batch.entries}
        if not batch.payload:
            return Header(msg_type=MsgType.PARAMS, step=first[1], bucket_id=first[0], meta=meta), None, []
        payload, states = batch.payload, batch.states
        if len(payload) > 1 and all(piece.numel() * piece.element_size() < COALESCE_BELOW for piece in payload):
            payload, states = [self._coalesce(peer, payload)], []  # copies: the buckets may change once this returns
        header = tensor_header(MsgType.PARAMS, payload, chunk_bytes, step=first[1], bucket_id=first[0], meta=meta)
        return header, payload, states

    def sent(self, handle: SendHandle) -> None:
        """The message of the last :meth:`take` was sent with ``handle``: its frame, if the batch was
        copied into one, is reused once the send is done. (Not called when the send failed: nothing
        reads the frame then, and it is dropped.)"""
        if self._unsent is not None:
            peer, frame, pool = self._unsent
            pool.lend(peer, handle, frame)
            self._unsent = None

    def _coalesce(self, peer: bytes, pieces: list[torch.Tensor]) -> torch.Tensor:
        dtype = pieces[0].dtype
        pool = self._frames.get(dtype)
        if pool is None:
            pool = self._frames[dtype] = SendBuffers(dtype)
        frame = pool.take(_COALESCED_BYTES // dtype.itemsize)
        self._unsent = (peer, frame, pool)
        out = frame[: sum(piece.numel() for piece in pieces)]
        torch.cat(pieces, out=out)
        return out
