"""Exactly-once steps across worker restarts: which process is each rank, what each rank still owes
the step in progress, and the parameter values a restarted rank needs to redo it.

A worker killed in the middle of its push leaves the node with part of its gradient of step ``k``:
buckets that every rank had pushed were already updated to ``k + 1``, the others wait. Its
replacement must compute the rest of the same gradient, so it needs the parameters of step ``k``,
including those of the buckets already updated. The ledger keeps, for every bucket updated to ``k +
1``, its step-``k`` values as they went out on the wire, until the step is over for every rank: the
first gradient of step ``k + 1`` (from any rank) proves it, because no rank can compute it before it
has every bucket of step ``k + 1``, so every rank has pushed all of step ``k`` to every node.

A restarted rank says HELLO with a new incarnation. :meth:`StepLedger.resume_point` tells it the
step to redo and which of that step's buckets already hold its gradient (it pushes only the others),
so no update ever misses a gradient or counts one twice. Messages from the replaced incarnation are
refused from then on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RankRecord:
    """The process that is a rank now: its connection, its incarnation and when it was last heard."""

    peer: bytes
    incarnation: int
    last_seen: float
    user_id: str | None = None  # the authenticated key it registered with (CURVE), bound to the connection
    left: bool = False  # it said BYE (closed its optimizer); a HELLO makes it part of the job again


@dataclass(slots=True)
class _Retained:
    step: int
    values: torch.Tensor  # flat, in the wire dtype
    owned: bool = True  # a buffer of the ledger's pool; else a view of memory kept elsewhere (the parameter board)


class StepLedger:
    """Owns the rank table and the retained step-``k`` parameter values of one node."""

    def __init__(self) -> None:
        self.ranks: dict[int, RankRecord] = {}
        self._rank_peers: frozenset[bytes] = frozenset()  # every rank's current connection, for O(1) lookups
        self._retained: dict[int, _Retained] = {}  # bucket -> values before its last update
        self._pool: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}  # buffers no bucket retains
        self._complete_before = 0  # every step below this one is over for every rank

    # ---------------------------------------------------------------- ranks

    def connections(self) -> Iterator[bytes]:
        """The transport identity of every rank's current incarnation, in rank order of registration."""
        return (record.peer for record in self.ranks.values())

    def is_rank_connection(self, peer: bytes) -> bool:
        """Whether ``peer`` is the current connection of some rank of the job."""
        return peer in self._rank_peers

    def peer(self, rank: int) -> bytes | None:
        record = self.ranks.get(rank)
        return None if record is None else record.peer

    def register(self, rank: int, peer: bytes, incarnation: int, user_id: str | None = None) -> str:
        """Record a HELLO; returns ``"new"``, ``"same"`` (the same connection again), ``"moved"`` (the
        same process on another connection, e.g. its same-host socket or after a node restart) or
        ``"restarted"`` (another process: the old one's messages are refused from now on).
        ``user_id`` is the key the HELLO came with: only messages with it count as the rank's."""
        now = time.time()
        previous = self.ranks.get(rank)
        self.ranks[rank] = RankRecord(peer, incarnation, now, user_id)
        self._rank_peers = frozenset(record.peer for record in self.ranks.values())
        if previous is None:
            return "new"
        if previous.incarnation != incarnation:
            return "restarted"
        return "same" if previous.peer == peer else "moved"

    def mark_left(self, rank: int) -> None:
        """``rank`` said BYE: it closed its optimizer (at the end of training, or on its way out)."""
        record = self.ranks.get(rank)
        if record is not None:
            record.left = True

    def all_left(self, world_size: int) -> bool:
        """Whether every rank of the job registered and then said BYE."""
        return len(self.ranks) == world_size and all(record.left for record in self.ranks.values())

    def present(self) -> list[RankRecord]:
        """The ranks that have not said BYE."""
        return [record for record in self.ranks.values() if not record.left]

    def is_current(self, rank: int, peer: bytes, user_id: str | None = None) -> bool:
        """Whether ``peer`` is the connection of ``rank``'s current incarnation, with the key it
        registered with (and note it was heard). The key matters because a client chooses its routing
        id: another key connecting with the same id (ZeroMQ hands the id over) is not the rank."""
        record = self.ranks.get(rank)
        if record is None or record.peer != peer or record.user_id != user_id:
            return False
        record.last_seen = time.time()
        return True

    def describe(self, rank: int, peer: bytes) -> str:
        """Why ``peer`` may not speak for ``rank``, for the error it gets."""
        record = self.ranks.get(rank)
        if record is None:
            return f"rank {rank} has not said HELLO"
        if record.peer == peer and record.user_id is not None:
            return f"rank {rank} registered with key {record.user_id[:8]}; this connection has another key (it took over the rank's routing id)"
        return f"rank {rank} has said HELLO on another connection (incarnation {record.incarnation:x}); this one is no longer part of the job"

    # ---------------------------------------------------------------- the step in progress

    @staticmethod
    def resume_point(rank: int, bucket_steps: dict[int, int], has_gradient: Callable[[int, int], bool]) -> tuple[int, list[int]]:
        """The step ``rank`` must (re)do at this node and the owned buckets that already hold its
        gradient of that step. ``bucket_steps``: owned bucket -> updates applied;
        ``has_gradient(bucket, rank)``: the bucket's gradients in flight include ``rank``'s.

        Buckets are at most one update apart (no rank can push step ``s + 1`` before every bucket
        reached it). The rank redoes the lowest step unless every bucket still at that step has its
        gradient; then it is at the next one, which has none of its gradients yet."""
        if not bucket_steps:
            return 0, []
        lowest = min(bucket_steps.values())
        behind = [b for b, s in bucket_steps.items() if s == lowest]
        if all(has_gradient(b, rank) for b in behind):
            return lowest + 1, []
        done = sorted(b for b, s in bucket_steps.items() if s > lowest or has_gradient(b, rank))
        return lowest, done

    # ---------------------------------------------------------------- retained values

    def retain(self, bucket_id: int, step: int, values: torch.Tensor, wire_dtype: torch.dtype) -> None:
        """Keep ``values`` (the bucket's fp32 parameters of ``step``) as they go out on the wire until
        step ``step`` is over for every rank. Called just before the bucket's update to ``step + 1``."""
        buffer = self.buffer_to_keep(bucket_id, step, values.numel(), wire_dtype)
        if buffer is not None:
            buffer.copy_(values)  # the same rounding as the cast for sending
            self.keep(bucket_id, step, buffer)

    def buffer_to_keep(self, bucket_id: int, step: int, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A buffer for the bucket's values of ``step``, to fill (the update pass does, while it reads
        them) and hand to :meth:`keep`; ``None`` when no rank can still need them. The bucket's older
        values are let go."""
        if step < self._complete_before:
            return None
        self._let_go(bucket_id)
        return self._take(numel, dtype)

    def keep(self, bucket_id: int, step: int, values: torch.Tensor, *, owned: bool = True) -> None:
        """Keep ``values``, the bucket's values of ``step`` in the wire dtype: the ledger owns them now,
        or (``owned=False``) they are a view of memory that holds them until the bucket's next update
        (the parameter board's other slot), which lets them go first (:meth:`may_need`)."""
        self._let_go(bucket_id)
        self._retained[bucket_id] = _Retained(step, values, owned)

    def may_need(self, bucket_id: int, step: int) -> bool:
        """Whether a rank may still need the bucket's values of ``step`` (then :meth:`keep` them); the
        bucket's older values are let go either way."""
        self._let_go(bucket_id)
        return step >= self._complete_before

    def swap_kept(self, bucket_id: int, step: int, values: torch.Tensor) -> torch.Tensor:
        """Keep ``values`` (what the node sent of ``step``, in the wire dtype) if a rank may still need
        them, and return a buffer of the same shape and dtype to send the next values from: with a
        16-bit wire, the outgoing copy is kept as it is, without a pass of its own."""
        spare = self.buffer_to_keep(bucket_id, step, values.numel(), values.dtype)
        if spare is None:  # no rank can still need them
            return values
        self.keep(bucket_id, step, values)
        return spare

    def retained(self, bucket_id: int, step: int) -> torch.Tensor | None:
        """The bucket's values of ``step`` if they are retained."""
        kept = self._retained.get(bucket_id)
        return kept.values if kept is not None and kept.step == step else None

    def gradient_of_step(self, step: int) -> None:
        """A gradient of ``step`` arrived: every step before it is over for every rank."""
        if step <= self._complete_before:
            return
        self._complete_before = step
        for bucket_id in [b for b, kept in self._retained.items() if kept.step < step]:
            self._let_go(bucket_id)

    def retained_bytes(self) -> int:
        return sum(kept.values.numel() * kept.values.element_size() for kept in self._retained.values())

    def _take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._pool.get((numel, dtype))
        return free.pop() if free else torch.empty(numel, dtype=dtype)

    def _let_go(self, bucket_id: int) -> None:
        kept = self._retained.pop(bucket_id, None)
        if kept is not None and kept.owned:
            self._give_back(kept.values)

    def _give_back(self, buffer: torch.Tensor) -> None:
        self._pool.setdefault((buffer.numel(), buffer.dtype), []).append(buffer)
