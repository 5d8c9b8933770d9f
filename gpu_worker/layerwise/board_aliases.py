"""Layer-wise CPU workers compute straight from a same-host node's parameter board.

A CPU worker that maps a node's board (:mod:`transport.shm.board`) would copy each unit's values out
of it twice a step (forward and backward), into memory it allocates for them: for an 85M-parameter
GPT, 0.65 GB a step and 10% of the worker's time. Where a parameter lies whole inside one bucket of
the job's wire dtype, it can instead be made a view of the board itself (``param.data = view``) for as
long as its unit is held: no copy, no allocation.

Why it is safe: a node writes a bucket's next values only once every rank pushed the gradients
computed from these (the board's promise), and a unit's values are read only until its last
parameter has its gradient, which is when the unit is pushed. Views of the board that autograd saved
in forward (``weight.t()``) keep reading the same slot in backward, which still holds the same
version. The promise is still checked: each board read is checked once its unit has its gradients
and before the push (after it, another rank's push may let the node rewrite the slot), and a broken
one raises rather than trains on torn values.

A parameter is filled either way within a step, never both in the same direction: once it was
copied into its own storage this step (a message from a socket, a shared window, a reconnect), it
stays copied until the step ends, because the tensors autograd saved in forward refer to that
storage and are refilled, not replaced.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from gpu_worker.layout import finish_board_read
from protos.job.placement import BucketSpec, Segment
from transport.interface import Message


class BoardAliases:
    """Which parameters of a layer-wise CPU worker are views of a node's board now, and the board
    reads their units hold (checked when the unit is pushed or let go)."""

    def __init__(self, params: list[torch.Tensor], buckets: list[BucketSpec], wire_dtype: torch.dtype, enabled: bool) -> None:
        self._params = params
        # Layout indices of the parameters that lie whole in one segment, in the wire's dtype.
        self._whole: set[int] = set()
        if enabled:
            for bucket in buckets:
                for seg in bucket.segments:
                    param = params[seg.param_index]
                    if seg.param_offset == 0 and seg.numel == param.numel() and param.dtype == wire_dtype and param.is_contiguous():
                        self._whole.add(seg.param_index)
        self._homes: dict[int, torch.Tensor] = {}  # the parameter's own (freed) storage, restored on release
        self._aliased: set[int] = set()
        self._copied_at: dict[int, int] = {}  # layout index -> the step it was last filled by a copy
        self._reads: defaultdict[int, list[tuple[Message, str]]] = defaultdict(list)  # unit index -> board reads held

    @property
    def viewing(self) -> set[int]:
        """Layout indices of the parameters that are views of a board now."""
        return self._aliased

    def install(self, bucket: BucketSpec, message: Message, step: int) -> Sequence[Segment]:
        """Make each parameter that lies whole in ``bucket`` a view of ``message``'s payload, where
        that is a board's (one view over its slot: :func:`transport.payload_views.board_payload_views`); the
        segments left for the caller to copy."""
        if message.still_current is None or len(message.tensors) != 1 or not self._whole:
            return bucket.segments
        payload = message.tensors[0][1]
        left = []
        for seg in bucket.segments:
            index = seg.param_index
            if index not in self._whole or self._copied_at.get(index) == step:
                left.append(seg)
                continue
            param = self._params[index]
            if index not in self._aliased:
                home = param.data
                home.untyped_storage().resize_(0)  # nothing of this step reads it (see the module docstring)
                self._homes[index] = home
                self._aliased.add(index)
            param.data = payload[seg.bucket_offset : seg.bucket_offset + seg.numel].view(param.shape)
        return left

    def will_copy(self, index: int, step: int) -> None:
        """The parameter is about to be filled by a copy: back to its own storage (still to be
        allocated by the caller), and copied for the rest of ``step``."""
        self._copied_at[index] = step
        self.release(index)

    def hold(self, unit_index: int, message: Message, node: str) -> None:
        """A board read some of ``unit_index``'s parameters are views of now."""
        self._reads[unit_index].append((message, node))

    def holds(self, unit_index: int) -> bool:
        return bool(self._reads.get(unit_index))

    def check(self, unit_index: int) -> None:
        """The unit's values are read no more: ``RuntimeError`` if a node rewrote any meanwhile, else
        let go of the board's pages the worker mapped for them."""
        for message, node in self._reads.pop(unit_index, ()):
            finish_board_read(message, node)

    def release(self, index: int) -> bool:
        """Give the parameter its own (empty) storage back if it is a view of a board; whether it was."""
        if index not in self._aliased:
            return False
        self._params[index].data = self._homes[index]
        self._aliased.discard(index)
        return True
