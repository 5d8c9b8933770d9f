"""``offload()``: layer-wise mode in one call."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from gpu_worker.layerwise.units import InitFn, plan_units
from gpu_worker.remote_adamw import RemoteAdamW
from netoptim.job.discovery import NodeSource


def offload(
    model: nn.Module,
    units: Sequence[nn.Module] | nn.ModuleList,
    *,
    nodes: NodeSource = None,
    params: Iterable[Any] | Callable[[nn.Module], Iterable[Any]] | None = None,
    prefetch: int = 1,
    init_fn: InitFn | None = None,
    device: torch.device | str | None = None,
    keep_for_backward: int = 0,
    **optimizer_options: Any,
) -> RemoteAdamW:
    """Stream ``model``'s ``units`` from the optimizer nodes and return its optimizer.

    The worker then holds, of the units' parameters, only the one computing and ``prefetch`` more
    (fetched ahead in forward order, and in reverse order in backward); the other parameters (the
    *root unit*: embeddings, head, and any parameter shared between units, such as tied weights) are
    fetched when the forward begins and freed once their gradients are pushed. Train as usual:
    ``loss.backward(); opt.step(); opt.zero_grad()``; ``step()`` returns without waiting for the
    update, and the next forward waits, unit by unit, only for what it needs.

    Args:
        model: the model. It may be built on the meta device (``with torch.device("meta"):``), in
            which case it is never materialized whole: rank 0 initializes one unit at a time with
            ``init_fn(name, tensor)`` (or the modules' ``reset_parameters()``) and sends the values
            straight to the nodes. A model with real values registers those.
        units: the modules to stream, in the order the forward calls them (``model.blocks``). They
            must not nest; activation checkpointing inside or around them works.
        nodes: the optimizer nodes: addresses, a host file's path, or ``None`` (the environment), as for
            :class:`RemoteAdamW`.
        params: what to give the optimizer (param groups or named parameters), or a function of the
            model that returns it (needed for a meta model, whose parameters are replaced here);
            default ``model.named_parameters()``.
        prefetch: units fetched ahead of the one computing.
        keep_for_backward: bytes of parameters that may stay from forward to backward. The last
            units forward runs are the first backward needs: as many of them as fit these bytes
            (counting back from the last) stay, and backward does not fetch them again. The last
            ``prefetch + 1`` units stay in any case (no more than forward held at once). Default 0:
            the least memory; the model's parameter bytes: each unit fetched once a step, not twice
            (DeepSpeed ZeRO-3 keeps parameters live up to its ``stage3_max_live_parameters``).
        init_fn: initializer for meta parameters, called once per parameter.
        device: where parameters are materialized (default: the model's device, CPU for a meta model).
        optimizer_options: :class:`RemoteAdamW` options (``lr``, ``weight_decay``, ``rank``,
            ``world_size``, ``wire_dtype``, ``max_grad_norm``, ``bucket_numel``, ``timeout_s``, ...).
            ``push_during_backward`` is implied.

    Gradients are pushed as backward completes each unit and then freed: read ``p.grad`` of a
    streamed parameter inside backward hooks only. Hyperparameters of a step are read when its
    first unit is pushed (change them before ``backward()``).
    """
    if optimizer_options.pop("push_during_backward", True) is False:
        raise ValueError("layer-wise mode always pushes gradients during backward")
    plan = plan_units(model, units, prefetch=prefetch, init_fn=init_fn, device=device, keep_for_backward=keep_for_backward)
    if params is None:
        params = model.named_parameters()
    elif callable(params):
        params = params(model)
    optimizer_options.setdefault("module", model)  # for its buffers (see RemoteAdamW's broadcast_buffers)
    return RemoteAdamW(params, nodes=nodes, units=plan, **optimizer_options)
