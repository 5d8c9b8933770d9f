"""Where a node keeps the fp32 master parameters and AdamW state of the buckets it owns.

``InMemoryStore`` keeps everything resident in host memory. The daemon only talks to the
:class:`BucketStore` interface, so an out-of-core store can replace it without touching the daemon.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from transport.interface import SendHandle


@dataclass(slots=True)
class BucketState:
    """The master copy and optimizer state of one bucket. ``step`` counts applied updates."""

    bucket_id: int
    param: torch.Tensor  # (numel,) fp32 master parameters
    exp_avg: torch.Tensor  # (numel,) fp32
    exp_avg_sq: torch.Tensor  # (numel,) fp32
    step_tensor: torch.Tensor  # () fp32, as torch's AdamW keeps it
    step: int = 0
    # (numel,) fp32 reduction buffer, made on first need: gradients that arrive as one fp32 frame
    # are summed in the frame itself and never need it.
    grad: torch.Tensor | None = None
    # Zero-copy sends still reading ``param`` (or the wire copy); waited for before the next update.
    pending_sends: list[SendHandle] = field(default_factory=list)
    wire_copy: torch.Tensor | None = None  # reused cast buffer when the wire dtype is not fp32

    @property
    def numel(self) -> int:
        return self.param.numel()

    def reduction_buffer(self) -> torch.Tensor:
        if self.grad is None:
            self.grad = torch.empty(self.numel, dtype=torch.float32)
        return self.grad

    @property
    def state_bytes(self) -> int:
        """Bytes held: parameters and both moments, plus the reduction buffer if one was needed."""
        return 4 * self.numel * (3 if self.grad is None else 4)


class BucketStore(ABC):
    """The node's state, one :class:`BucketState` per owned bucket."""

    @abstractmethod
    def create(self, bucket_id: int, initial: torch.Tensor) -> BucketState:
        """Create a bucket from its initial fp32 values (copied); ``ValueError`` if it exists."""

    @abstractmethod
    def get(self, bucket_id: int) -> BucketState | None:
        """The bucket's state, or ``None`` if it was never created."""

    @abstractmethod
    def __iter__(self) -> Iterator[BucketState]:
        """All created buckets in id order."""

    @abstractmethod
    def __len__(self) -> int: ...


class InMemoryStore(BucketStore):
    """All state resident in host memory."""

    def __init__(self) -> None:
        self._buckets: dict[int, BucketState] = {}

    def create(self, bucket_id: int, initial: torch.Tensor) -> BucketState:
        if bucket_id in self._buckets:
            raise ValueError(f"bucket {bucket_id} already exists")
        numel = initial.numel()
        state = BucketState(
            bucket_id=bucket_id,
            param=initial.to(torch.float32, copy=True).reshape(-1),
            exp_avg=torch.zeros(numel, dtype=torch.float32),
            exp_avg_sq=torch.zeros(numel, dtype=torch.float32),
            step_tensor=torch.zeros((), dtype=torch.float32),
        )
        self._buckets[bucket_id] = state
        return state

    def get(self, bucket_id: int) -> BucketState | None:
        return self._buckets.get(bucket_id)

    def __iter__(self) -> Iterator[BucketState]:
        return iter(sorted(self._buckets.values(), key=lambda b: b.bucket_id))

    def __len__(self) -> int:
        return len(self._buckets)
