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
    grad: torch.Tensor  # (numel,) fp32 reduction buffer, reused every step
    step: int = 0
    # Zero-copy sends still reading ``param`` (or the wire copy); waited for before the next update.
    pending_sends: list[SendHandle] = field(default_factory=list)
    wire_copy: torch.Tensor | None = None  # reused cast buffer when the wire dtype is not fp32

    @property
    def numel(self) -> int:
        return self.param.numel()

    @property
    def state_bytes(self) -> int:
        return 4 * 4 * self.numel


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
            grad=torch.empty(numel, dtype=torch.float32),
        )
        self._buckets[bucket_id] = state
        return state

    def get(self, bucket_id: int) -> BucketState | None:
        return self._buckets.get(bucket_id)

    def __iter__(self) -> Iterator[BucketState]:
        return iter(sorted(self._buckets.values(), key=lambda b: b.bucket_id))

    def __len__(self) -> int:
        return len(self._buckets)
