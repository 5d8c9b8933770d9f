"""Module buffers kept equal across data-parallel workers, as DDP keeps them.

Buffers are not parameters: no gradient and no optimizer step changes them, forward does (BatchNorm's
running mean and variance, its ``num_batches_tracked``). Each worker's forward sees only its own
shard, so the ranks' buffers drift apart unless something makes them equal. DDP, by default
(``broadcast_buffers=True``), broadcasts rank 0's buffers to every rank at the start of a forward
that follows a training forward; :class:`BufferBroadcast` does exactly that, over the job's
``torch.distributed`` process group (gloo is enough; workers under ``torchrun`` have what it needs).

When a model's statistics should be those of the whole global batch rather than rank 0's shard,
convert it with ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` instead (it all-reduces inside
forward) and turn the broadcast off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

log = logging.getLogger(__name__)


class BufferBroadcast:
    """A forward pre-hook on ``module`` that copies rank 0's buffers to every rank, as DDP does.

    Like DDP, it broadcasts before a forward when the forward before it ran with gradients enabled
    and outside ``no_sync`` (so also before the first one): an evaluation forward under
    ``torch.no_grad()`` after training sees rank 0's buffers, and the one after it does not
    broadcast again. ``sync_enabled`` tells whether the optimizer is inside ``no_sync``.
    """

    def __init__(self, module: nn.Module, sync_enabled: Callable[[], bool], group: dist.ProcessGroup | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "broadcasting buffers needs torch.distributed: call torch.distributed.init_process_group('gloo') in every worker "
                "(torchrun sets what it needs), or pass broadcast_buffers=False (each rank then keeps its own buffers)"
            )
        self.module = module
        self.group = group
        self.sync_enabled = sync_enabled
        self.broadcasts = 0
        self._sync_next = True  # DDP broadcasts before the first forward too
        self._handle: RemovableHandle | None = module.register_forward_pre_hook(self._before_forward)
        log.debug("rank 0's buffers go to every rank before each training forward (%d buffers)", len(list(module.buffers())))

    def _before_forward(self, _module: nn.Module, _args: object) -> None:
        if self._sync_next:
            self.broadcast()
        self._sync_next = torch.is_grad_enabled() and self.sync_enabled()

    @torch.no_grad()
    def broadcast(self) -> None:
        """Copy rank 0's buffers to this rank now, one flat broadcast per device and dtype."""
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for buffer in self.module.buffers():
            by_kind.setdefault((buffer.device, buffer.dtype), []).append(buffer)
        for tensors in by_kind.values():
            flat = torch._utils._flatten_dense_tensors(tensors)
            dist.broadcast(flat, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0, group=self.group)
            for tensor, value in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors), strict=True):
                tensor.copy_(value)
        self.broadcasts += 1

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
