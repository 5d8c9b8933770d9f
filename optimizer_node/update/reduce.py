"""Summing the gradients of all data-parallel workers for one bucket and one step.

Gradients are added in rank order whatever order they arrive in, so the sum is bitwise reproducible
(floating-point addition is not associative). A gradient that arrives before its turn is held as a
zero-copy view of the received frames until the ranks before it are in.

With ``defer=True`` the summation that the last arrival would trigger is left to the update pass
(:func:`optimizer_node.update.bucket_pass.reduce_and_update`), which adds those gradients in the same pass
as AdamW: the sum is never written to memory and read back. Memory stays bounded as it was: the
frames held are the ones the completing arrival would have summed (at most ``world_size`` frames, as
when gradients arrive last rank first), held until the update instead of until that arrival; a
partial sum is made only of ranks that arrived in order before the last one, and a lone rank 0 in
bf16/fp16 is held as its frame rather than copied into an fp32 buffer twice its size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TensorPieces = list[tuple[int, torch.Tensor]]
"""A flat tensor as ``(element_offset, view)`` pieces, as received from the wire."""


class OrderedReduction:
    """Accumulates ``world_size`` gradients of ``numel`` elements in rank order.

    When rank 0's gradient arrived as one writable fp32 frame, that frame itself becomes the
    accumulator: no copy of the bucket (a quarter of the node's memory traffic with two workers) and
    no buffer of its own. Otherwise ``buffer()`` provides the fp32 accumulator.

    :attr:`result` is the sum once :attr:`complete`; with ``defer`` it finishes the deferred additions
    on first access (global-norm clipping needs the whole sum before any update), and
    :meth:`take_pending` hands them to the update pass instead.
    """

    def __init__(self, numel: int, world_size: int, buffer: Callable[[], torch.Tensor], *, defer: bool = False) -> None:
        self.numel = numel
        self._buffer = buffer
        self.world_size = world_size
        self.defer = defer
        self.received: set[int] = set()
        self._sum: torch.Tensor | None = None  # ranks below _next_rank, added in order
        self._held: dict[int, TensorPieces] = {}
        self._next_rank = 0

    @property
    def complete(self) -> bool:
        return len(self.received) == self.world_size

    def missing(self) -> list[int]:
        return [rank for rank in range(self.world_size) if rank not in self.received]

    @property
    def result(self) -> torch.Tensor | None:
        """The fp32 sum of every rank once complete (the sum so far before); ``None`` if nothing is summed."""
        if self.complete:
            self._fold(self.world_size)
        return self._sum

    def add(self, rank: int, pieces: TensorPieces) -> None:
        """Take rank ``rank``'s gradient; the caller has checked rank range, size and duplicates.
        No pieces: the rank had no gradient for any parameter of the bucket; it adds zeros."""
        assert 0 <= rank < self.world_size and rank not in self.received
        self.received.add(rank)
        self._held[rank] = pieces
        if self.defer and self.complete:
            return  # the update pass adds what is still held, chunk by chunk
        end = self._next_rank
        while end in self._held:
            end += 1
        if self.defer and self._next_rank == 0 and end == 1 and not self._adoptable(self._held[0]):
            end = 0  # rank 0 alone would be copied into a new fp32 buffer: hold its frame until rank 1 comes
        self._fold(end)

    def take_pending(self) -> list[TensorPieces]:
        """The complete sum's terms still to add, in rank order (the partial sum first, if any); the
        reduction lets go of them, so the received frames are freed once the caller is done."""
        assert self.complete, "the update pass needs every gradient"
        terms: list[TensorPieces] = [] if self._sum is None else [[(0, self._sum)]]
        terms += [self._held.pop(rank) for rank in range(self._next_rank, self.world_size)]
        self._sum = None
        self._next_rank = self.world_size
        return terms

    def _adoptable(self, pieces: TensorPieces) -> bool:
        return len(pieces) == 1 and pieces[0][1].dtype == torch.float32 and pieces[0][1].numel() == self.numel

    def _fold(self, end: int) -> None:
        """Add the held ranks ``_next_rank .. end - 1`` (all held) to the sum, in order."""
        while self._next_rank < end:
            self._accumulate(self._held.pop(self._next_rank), first=self._next_rank == 0)
            self._next_rank += 1

    def _accumulate(self, pieces: TensorPieces, *, first: bool) -> None:
        if first and self._adoptable(pieces):
            self._sum = pieces[0][1]
            return
        if self._sum is None:
            self._sum = self._buffer()
            assert self._sum.dtype == torch.float32 and self._sum.numel() == self.numel
            if not pieces:
                self._sum.zero_()  # a first rank without a gradient: the sum starts at zero, as DDP's zeros
        for offset, view in pieces:
            target = self._sum[offset : offset + view.numel()]
            if first:
                target.copy_(view)  # casts bf16/fp16 up to fp32
            elif view.dtype == torch.float32:
                target.add_(view)
            else:
                # Upcast first (exact): torch's mixed-dtype in-place add takes a slow scalar path, ~7x slower.
                target.add_(view.to(torch.float32))
