"""Which buckets of a full-model worker have every gradient of the step, as backward produces them.

A gradient hook on each parameter (``register_post_accumulate_grad_hook``) tells :meth:`mark` that the
parameter's gradient is final; a bucket is ready once every parameter of it that trains now has
one, and can be pushed before backward ends (``push_during_backward``). Frozen parameters get no
hook (torch refuses one) and no gradient; one unfrozen after the hooks were made has no hook, so its
bucket waits for ``step()``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from protos.job.placement import BucketSpec


class BucketReadiness:
    """Per step: the parameters of each bucket whose gradient is in, and the hooks that say so."""

    def __init__(self) -> None:
        self.param_buckets: list[list[int]] = []  # layout index -> the buckets holding a piece of it
        self._bucket_params: list[frozenset[int]] = []
        self._params: Sequence[torch.Tensor] = ()
        self._ready: list[set[int]] = []
        self._needed: list[int | None] = []  # per step: gradients a bucket waits for in backward (-1: waits for step())
        self._hooked: set[int] = set()
        self._handles: list = []

    def index(self, buckets: Sequence[BucketSpec], params: Sequence[torch.Tensor]) -> None:
        """Which parameters each bucket holds and the other way round (after construction, or after a
        param group was added: every bucket starts the step anew)."""
        self._params = params
        self._bucket_params = [frozenset(seg.param_index for seg in bucket.segments) for bucket in buckets]
        self.param_buckets = [[] for _ in params]
        for bucket in buckets:
            for seg in bucket.segments:
                self.param_buckets[seg.param_index].append(bucket.bucket_id)
        self._ready = [set() for _ in buckets]
        self._needed = [None] * len(buckets)

    def hook(self, on_grad: Callable[[int, torch.Tensor], None]) -> None:
        """A gradient hook, ``on_grad(layout_index, param)``, on each trainable parameter without one yet."""
        new = [i for i, p in enumerate(self._params) if p.requires_grad and i not in self._hooked]
        self._hooked.update(new)
        self._handles += [self._params[i].register_post_accumulate_grad_hook(functools.partial(on_grad, i)) for i in new]

    def mark(self, index: int, name: str) -> list[int]:
        """Parameter ``index`` (called ``name``) has its gradient: the buckets that became ready.
        ``RuntimeError`` for a second gradient in one step."""
        ready_now = []
        for bucket_id in self.param_buckets[index]:
            ready = self._ready[bucket_id]
            if index in ready:
                raise RuntimeError(f"parameter {name!r} got a second gradient before step(); accumulate gradients inside optimizer.no_sync()")
            ready.add(index)
            if self._is_ready(bucket_id):
                ready_now.append(bucket_id)
        return ready_now

    def _is_ready(self, bucket_id: int) -> bool:
        # What a bucket needs is worked out once a step: a hook per parameter must stay O(1).
        needed = self._needed[bucket_id]
        if needed is None:
            trainable = [i for i in self._bucket_params[bucket_id] if self._params[i].requires_grad]
            needed = self._needed[bucket_id] = len(trainable) if all(i in self._hooked for i in trainable) else -1
        return len(self._ready[bucket_id]) == needed

    def new_step(self) -> None:
        """The step is over: no gradient is in."""
        for ready in self._ready:
            ready.clear()
        self._needed = [None] * len(self._ready)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
