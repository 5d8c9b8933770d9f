"""Summing the gradients of all data-parallel workers for one bucket and one step.

Gradients are added in rank order whatever order they arrive in, so the sum is bitwise reproducible
(floating-point addition is not associative). A gradient that arrives before its turn is held as a
zero-copy view of the received frames until the ranks before it are in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TensorPieces = list[tuple[int, torch.Tensor]]
"""A flat tensor as ``(element_offset, view)`` pieces, as received from the wire."""


class OrderedReduction:
    """Accumulates ``world_size`` gradients of ``numel`` elements in rank order into :attr:`result`.

    When rank 0's gradient arrived as one writable fp32 frame, that frame itself becomes the
    accumulator: no copy of the bucket (a quarter of the node's memory traffic with two workers) and
    no buffer of its own. Otherwise ``buffer()`` provides the fp32 accumulator.
    """

    def __init__(self, numel: int, world_size: int, buffer: Callable[[], torch.Tensor]) -> None:
        self.numel = numel
        self._buffer = buffer
        self.result: torch.Tensor | None = None
        self.world_size = world_size
        self.received: set[int] = set()
        self._held: dict[int, TensorPieces] = {}
        self._next_rank = 0

    @property
    def complete(self) -> bool:
        return self._next_rank == self.world_size

    def missing(self) -> list[int]:
        return [rank for rank in range(self.world_size) if rank not in self.received]

    def add(self, rank: int, pieces: TensorPieces) -> None:
        """Take rank ``rank``'s gradient; the caller has checked rank range, size and duplicates."""
        assert 0 <= rank < self.world_size and rank not in self.received
        self.received.add(rank)
        self._held[rank] = pieces
        while self._next_rank in self._held:
            self._accumulate(self._held.pop(self._next_rank), first=self._next_rank == 0)
            self._next_rank += 1

    def _accumulate(self, pieces: TensorPieces, *, first: bool) -> None:
        if first and len(pieces) == 1 and pieces[0][1].dtype == torch.float32 and pieces[0][1].numel() == self.numel:
            self.result = pieces[0][1]
            return
        if self.result is None:
            self.result = self._buffer()
            assert self.result.dtype == torch.float32 and self.result.numel() == self.numel
        for offset, view in pieces:
            target = self.result[offset : offset + view.numel()]
            if first:
                target.copy_(view)  # casts bf16/fp16 up to fp32
            elif view.dtype == torch.float32:
                target.add_(view)
            else:
                # Upcast first (exact): torch's mixed-dtype in-place add takes a slow scalar path, ~7x slower.
                target.add_(view.to(torch.float32))
