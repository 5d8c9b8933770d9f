"""``offload()``: layer-wise mode in one call."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from gpu_worker.discovery import NodeSource
from gpu_worker.layerwise.units import InitFn, plan_units
from gpu_worker.remote_adamw import RemoteAdamW
from gpu_worker.remote_optimizer import RemoteOptions


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
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    push_during_backward: bool = True,
    module: nn.Module | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    wire_dtype: torch.dtype = torch.float32,
    max_grad_norm: float | None = None,
    bucket_numel: int | None = None,
    bucket_layout: int | None = None,
    timeout_s: float = 300.0,
    connect_timeout_s: float = 30.0,
    heartbeat_s: float = 2.0,
    silent_after_s: float = 10.0,
    reconnect_s: float = 20.0,
    curve_secret_key: str | None = None,
    curve_server_key: str | None = None,
    push_window_bytes: int = 1 << 30,
    pace_window_bytes: int | None = None,
    same_host_ipc: bool = True,
    connections_per_node: int = 1,
    broadcast_buffers: bool = True,
    join_at_step: int | None = None,
    local_size: int = 1,
    node_bandwidths: Sequence[float] | None = None,
    overlap_forward: bool = False,
    keep_step_gradients: bool = True,
    moments: str = "fp32",
    moment_block: int = 256,
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
        lr, betas, eps, weight_decay: as in ``torch.optim.AdamW`` (the optimizer is a :class:`RemoteAdamW`).
        push_during_backward: always ``True`` in layer-wise mode (``False`` is refused).
        module: the model whose buffers rank 0 broadcasts (see ``broadcast_buffers``); default ``model``.
        rank, world_size: this worker's rank and the job's data-parallel width (default: torch.distributed's,
            else ``RANK``/``WORLD_SIZE``, else 0 and 1).
        wire_dtype: dtype of gradients and parameters on the wire (float32, bfloat16 or float16).
        max_grad_norm: clip the averaged gradient to this global L2 norm (``None``: no clipping).
        bucket_numel: elements per transfer/update unit (``None``: chosen for the model and node count).
        bucket_layout: 1 fills each bucket, 2 never splits a parameter that fits one (``None``: the mode's).
        timeout_s: how long a wait for the nodes may go without progress before a ``TimeoutError``.
        connect_timeout_s: how long a node may take to answer the first HELLO.
        heartbeat_s, silent_after_s, reconnect_s: ping a node silent this long; take one silent this long
            for gone; reconnect to it for up to this long.
        curve_secret_key, curve_server_key: this worker's secret key file and the node's public key file (CURVE).
        push_window_bytes: layer-wise mode: gradient bytes pushed and not yet consumed by the nodes.
        pace_window_bytes: full-model mode with ``push_during_backward``: gradient bytes pushed whose
            values have not come back (``None``: no window).
        same_host_ipc: move to a same-host node's Unix socket.
        connections_per_node: TCP connections to each node.
        broadcast_buffers: with ``module``: rank 0's buffers reach every rank at each training forward.
        join_at_step: a worker joining a running job at this step (:mod:`gpu_worker.elastic`).
        local_size: the workers behind this rank whose gradients it pushes summed (a host group's leader).
        node_bandwidths: each node's link bandwidth: buckets are shared out in proportion.
        overlap_forward: full-model mode, with ``module``: the next forward waits for each module's new values.
        keep_step_gradients: hold each step's gradients until its values are in (a node may restart mid-step).
        moments, moment_block: how the nodes store the moments (``"fp32"``, ``"bf16"``, ``"8bit"``), as :class:`~gpu_worker.RemoteAdamW`.

    The options from ``rank`` on are :class:`RemoteAdamW`'s, with its defaults; its docstring
    describes each in full.

    Gradients are pushed as backward completes each unit and then freed: read ``p.grad`` of a
    streamed parameter inside backward hooks only. Hyperparameters of a step are read when its
    first unit is pushed (change them before ``backward()``).
    """
    if push_during_backward is False:
        raise ValueError("layer-wise mode always pushes gradients during backward")
    plan = plan_units(model, units, prefetch=prefetch, init_fn=init_fn, device=device, keep_for_backward=keep_for_backward)
    if params is None:
        params = model.named_parameters()
    elif callable(params):
        params = params(model)
    if module is None:
        module = model  # for its buffers (see RemoteAdamW's broadcast_buffers)
    options = RemoteOptions.from_arguments({**locals(), "units": plan})
    return RemoteAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **options.as_kwargs())
