"""accelerate without gradient all-reduce: the model is prepared but never wrapped in
``DistributedDataParallel``, because the optimizer nodes sum the ranks' gradients and average them once.

In a script with its own loop, two lines change::

    from gpu_worker import RemoteAdamW
    from netoptim.integrations.hf_accelerate import NetoptimAccelerator

    accelerator = NetoptimAccelerator()  # was: Accelerator()
    optimizer = RemoteAdamW(model.named_parameters(), lr=3e-4, nodes=NODES, max_grad_norm=1.0)  # was: torch.optim.AdamW(...)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

``accelerator.backward``, ``accumulate``/``no_sync`` and the prepared scheduler work as before;
``accelerator.clip_grad_norm_(params, 1.0)`` is left to the nodes, which clip the averaged gradient to
the optimizer's ``max_grad_norm`` (it must be the same value), and returns ``None``: the norm is
``optimizer.last_grad_norm`` once ``step()`` has run. FSDP and DeepSpeed shard what netoptim keeps on
the nodes and are refused.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from gpu_worker import RemoteOptimizer
from netoptim.integrations._extras import require
from netoptim.integrations.remote import remote_optimizers

accelerate = require("accelerate", by="netoptim.integrations.hf_accelerate")

SHARDING = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")
"""accelerate's distributed types that shard or wrap the model themselves: not with netoptim."""


def check_no_sharding(accelerator: Any) -> None:
    """``ValueError`` when ``accelerator`` is set up for DeepSpeed, FSDP, Megatron-LM or XLA."""
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind in SHARDING:
        raise ValueError(
            f"netoptim keeps the optimizer state and the master parameters on its nodes, so it replaces {kind} rather than running under it: "
            "launch without a DeepSpeed/FSDP/Megatron-LM config (plain torchrun, or accelerate launch --multi_gpu)"
        )


class NetoptimAccelerator(accelerate.Accelerator):
    """An ``accelerate.Accelerator`` whose ``prepare`` places the model (device, autocast, compile) but
    does not wrap it in ``DistributedDataParallel``: each rank's local gradients go to the optimizer
    nodes, which average them. Give it a remote optimizer (:class:`~gpu_worker.RemoteAdamW`)."""

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False) -> torch.nn.Module:
        """The model on its device, with mixed-precision autocast and ``torch.compile`` as configured,
        never wrapped for gradient synchronization (accelerate's ``evaluation_mode`` path)."""
        check_no_sharding(self)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        """A remote optimizer keeps no state on the worker, so there is nothing to move: it is wrapped
        without the state-dict round trip (which would read every moment from the nodes and send it back)."""
        if remote_optimizers([optimizer]):
            device_placement = False
        return super().prepare_optimizer(optimizer, device_placement=device_placement)

    def netoptim_optimizers(self) -> list[RemoteOptimizer]:
        """The remote optimizers this accelerator prepared."""
        return remote_optimizers(self._optimizers)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Gradient accumulation: backward passes inside do not push (the remote optimizers' ``no_sync``,
        which matters with ``push_during_backward=True``); the next one outside pushes the sum."""
        with contextlib.ExitStack() as stack:
            for optimizer in self.netoptim_optimizers():
                stack.enter_context(optimizer.no_sync())
            stack.enter_context(super().no_sync(model))
            yield

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2) -> torch.Tensor | None:
        """With a remote optimizer the nodes clip the averaged gradient by its global norm, so nothing is
        clipped here (clipping each rank's local gradient is not what DDP does); returns ``None``, the
        norm arrives as ``optimizer.last_grad_norm`` with the new parameters. ``ValueError`` when the
        remote optimizer was not made with ``max_grad_norm=max_norm``. Without one: accelerate's."""
        remote = self.netoptim_optimizers()
        if not remote:
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        if math.isinf(max_norm):  # only the norm was asked for (the Trainer's logging): the nodes report it after step()
            return None
        if float(norm_type) != 2.0:
            raise ValueError(f"the optimizer nodes clip by the L2 norm, not norm_type={norm_type}")
        for optimizer in remote:
            if optimizer.max_grad_norm != float(max_norm):
                raise ValueError(
                    f"the optimizer nodes clip the averaged gradient to the remote optimizer's max_grad_norm ({optimizer.max_grad_norm}), "
                    f"not to {max_norm}: make the {type(optimizer).__name__} with max_grad_norm={max_norm}"
                )
        return None


def without_gradient_sync(accelerator: Any) -> Any:
    """Make an existing ``accelerate.Accelerator`` a :class:`NetoptimAccelerator` (for frameworks that
    build their own, such as ``transformers.Trainer``); ``ValueError`` under DeepSpeed or FSDP."""
    check_no_sharding(accelerator)
    if not isinstance(accelerator, NetoptimAccelerator):
        base = type(accelerator)
        cls = NetoptimAccelerator if base is accelerate.Accelerator else type(f"Netoptim{base.__name__}", (NetoptimAccelerator, base), {})
        accelerator.__class__ = cls  # the subclass adds methods only, no state
    return accelerator
