"""Remote optimizers with other update rules than AdamW: drop-ins for ``torch.optim.Adam`` and
``torch.optim.SGD`` (momentum, dampening, Nesterov), and Lion, a rule that keeps one moment instead
of two when the state does not fit. Each takes the options of :class:`~gpu_worker.RemoteAdamW`
(``nodes``, ``rank``, ``world_size``, ``wire_dtype``, ``max_grad_norm``, ...) and behaves like it;
only the update on the nodes differs (see :mod:`optimizer_node.update.rules`). AdamW stays the fast path:
the others update each parameter piece with torch's kernel of the rule, not the one-pass loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch

from gpu_worker.discovery import NodeSource
from gpu_worker.layerwise.units import UnitPlan
from gpu_worker.remote_adamw import TORCH_ADAMW_GROUP_KEYS
from gpu_worker.remote_optimizer import RemoteOptimizer, RemoteOptions
from protos.job.hyper import AdamWHyper, validate_for_rule


class RemoteAdam(RemoteOptimizer):
    """``torch.optim.Adam`` (weight decay as L2 on the gradient) with its state on the nodes;
    bitwise equal to ``torch.optim.Adam(fused=True)`` fed the averaged gradient.

    Args:
        params: parameters, ``named_parameters()``, or param groups, as for :class:`~gpu_worker.RemoteAdamW`.
        lr, betas, eps, weight_decay: as in ``torch.optim.Adam`` (weight decay added to the gradient).
        nodes: where the optimizer nodes are: addresses, a host file's path, or ``None`` (the environment).
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
        push_during_backward: push each bucket as soon as backward has produced its gradients.
        curve_secret_key, curve_server_key: this worker's secret key file and the node's public key file (CURVE).
        units: layer-wise mode's plan (:func:`gpu_worker.offload` sets it).
        push_window_bytes: layer-wise mode: gradient bytes pushed and not yet consumed by the nodes.
        pace_window_bytes: full-model mode with ``push_during_backward``: gradient bytes pushed whose
            values have not come back (``None``: no window).
        same_host_ipc: move to a same-host node's Unix socket.
        connections_per_node: TCP connections to each node.
        module: the model the parameters belong to, for its buffers and ``overlap_forward``.
        broadcast_buffers: with ``module``: rank 0's buffers reach every rank at each training forward.
        join_at_step: a worker joining a running job at this step (:mod:`gpu_worker.elastic`).
        local_size: the workers behind this rank whose gradients it pushes summed (a host group's leader).
        node_bandwidths: each node's link bandwidth: buckets are shared out in proportion.
        overlap_forward: full-model mode, with ``module``: the next forward waits for each module's new values.
        keep_step_gradients: hold each step's gradients until its values are in (a node may restart mid-step).
        moments, moment_block: how the nodes store the moments (``"fp32"``, ``"bf16"``, ``"8bit"``), as :class:`~gpu_worker.RemoteAdamW`.

    The options after the hyperparameters are :class:`~gpu_worker.RemoteAdamW`'s, with the same
    defaults; its docstring describes each in full.
    """

    rule = "adam"
    torch_group_keys: ClassVar[dict[str, Any]] = {**TORCH_ADAMW_GROUP_KEYS, "decoupled_weight_decay": False}

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        nodes: NodeSource = None,
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
        push_during_backward: bool = False,
        curve_secret_key: str | None = None,
        curve_server_key: str | None = None,
        units: UnitPlan | None = None,
        push_window_bytes: int = 1 << 30,
        pace_window_bytes: int | None = None,
        same_host_ipc: bool = True,
        connections_per_node: int = 1,
        module: torch.nn.Module | None = None,
        broadcast_buffers: bool = True,
        join_at_step: int | None = None,
        local_size: int = 1,
        node_bandwidths: Sequence[float] | None = None,
        overlap_forward: bool = False,
        keep_step_gradients: bool = True,
        moments: str = "fp32",
        moment_block: int = 256,
    ) -> None:
        validate_for_rule(self.rule, AdamWHyper(float(lr), betas[0], betas[1], eps, weight_decay))
        self._setup(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}, RemoteOptions.from_arguments(locals()))


class RemoteSGD(RemoteOptimizer):
    """``torch.optim.SGD`` with momentum, dampening and Nesterov, the momentum buffer on the nodes;
    bitwise equal to ``torch.optim.SGD(fused=True)`` fed the averaged gradient. Momentum and
    dampening must lie in [0, 1).

    Args:
        params: parameters, ``named_parameters()``, or param groups, as for :class:`~gpu_worker.RemoteAdamW`.
        lr, momentum, dampening, weight_decay, nesterov: as in ``torch.optim.SGD``.
        nodes: where the optimizer nodes are: addresses, a host file's path, or ``None`` (the environment).
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
        push_during_backward: push each bucket as soon as backward has produced its gradients.
        curve_secret_key, curve_server_key: this worker's secret key file and the node's public key file (CURVE).
        units: layer-wise mode's plan (:func:`gpu_worker.offload` sets it).
        push_window_bytes: layer-wise mode: gradient bytes pushed and not yet consumed by the nodes.
        pace_window_bytes: full-model mode with ``push_during_backward``: gradient bytes pushed whose
            values have not come back (``None``: no window).
        same_host_ipc: move to a same-host node's Unix socket.
        connections_per_node: TCP connections to each node.
        module: the model the parameters belong to, for its buffers and ``overlap_forward``.
        broadcast_buffers: with ``module``: rank 0's buffers reach every rank at each training forward.
        join_at_step: a worker joining a running job at this step (:mod:`gpu_worker.elastic`).
        local_size: the workers behind this rank whose gradients it pushes summed (a host group's leader).
        node_bandwidths: each node's link bandwidth: buckets are shared out in proportion.
        overlap_forward: full-model mode, with ``module``: the next forward waits for each module's new values.
        keep_step_gradients: hold each step's gradients until its values are in (a node may restart mid-step).
        moments, moment_block: how the nodes store the moments (``"fp32"``, ``"bf16"``, ``"8bit"``), as :class:`~gpu_worker.RemoteAdamW`.

    The options after the hyperparameters are :class:`~gpu_worker.RemoteAdamW`'s, with the same
    defaults; its docstring describes each in full.
    """

    torch_group_keys: ClassVar[dict[str, Any]] = {"maximize": False, "foreach": None, "differentiable": False, "fused": True}

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        nodes: NodeSource = None,
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
        push_during_backward: bool = False,
        curve_secret_key: str | None = None,
        curve_server_key: str | None = None,
        units: UnitPlan | None = None,
        push_window_bytes: int = 1 << 30,
        pace_window_bytes: int | None = None,
        same_host_ipc: bool = True,
        connections_per_node: int = 1,
        module: torch.nn.Module | None = None,
        broadcast_buffers: bool = True,
        join_at_step: int | None = None,
        local_size: int = 1,
        node_bandwidths: Sequence[float] | None = None,
        overlap_forward: bool = False,
        keep_step_gradients: bool = True,
        moments: str = "fp32",
        moment_block: int = 256,
    ) -> None:
        self.rule = "sgd-nesterov" if nesterov else "sgd"  # one rule per job: every group uses it
        validate_for_rule(self.rule, AdamWHyper(float(lr), momentum, dampening, 0.0, weight_decay))
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay, "nesterov": nesterov}
        self._setup(params, defaults, RemoteOptions.from_arguments(locals()))
        if any(bool(group["nesterov"]) != nesterov for group in self.param_groups):
            raise ValueError("nesterov is one choice for the whole optimizer: every param group must use the constructor's")

    def _group_hyper(self, group: dict[str, Any]) -> AdamWHyper:
        return AdamWHyper(float(group["lr"]), float(group["momentum"]), float(group["dampening"]), 0.0, float(group["weight_decay"]))


class RemoteLion(RemoteOptimizer):
    """Lion (Chen et al., 2023): the sign of an interpolation of momentum and gradient is the update,
    with decoupled weight decay; one moment per parameter. Typical settings: a learning rate 3-10x
    smaller than AdamW's and a weight decay 3-10x larger.

    Args:
        params: parameters, ``named_parameters()``, or param groups, as for :class:`~gpu_worker.RemoteAdamW`.
        lr, betas, weight_decay: Lion's learning rate, its two interpolation factors, and decoupled weight decay.
        nodes: where the optimizer nodes are: addresses, a host file's path, or ``None`` (the environment).
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
        push_during_backward: push each bucket as soon as backward has produced its gradients.
        curve_secret_key, curve_server_key: this worker's secret key file and the node's public key file (CURVE).
        units: layer-wise mode's plan (:func:`gpu_worker.offload` sets it).
        push_window_bytes: layer-wise mode: gradient bytes pushed and not yet consumed by the nodes.
        pace_window_bytes: full-model mode with ``push_during_backward``: gradient bytes pushed whose
            values have not come back (``None``: no window).
        same_host_ipc: move to a same-host node's Unix socket.
        connections_per_node: TCP connections to each node.
        module: the model the parameters belong to, for its buffers and ``overlap_forward``.
        broadcast_buffers: with ``module``: rank 0's buffers reach every rank at each training forward.
        join_at_step: a worker joining a running job at this step (:mod:`gpu_worker.elastic`).
        local_size: the workers behind this rank whose gradients it pushes summed (a host group's leader).
        node_bandwidths: each node's link bandwidth: buckets are shared out in proportion.
        overlap_forward: full-model mode, with ``module``: the next forward waits for each module's new values.
        keep_step_gradients: hold each step's gradients until its values are in (a node may restart mid-step).
        moments, moment_block: how the nodes store the moments (``"fp32"``, ``"bf16"``, ``"8bit"``), as :class:`~gpu_worker.RemoteAdamW`.

    The options after the hyperparameters are :class:`~gpu_worker.RemoteAdamW`'s, with the same
    defaults; its docstring describes each in full.
    """

    rule = "lion"
    torch_group_keys: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        nodes: NodeSource = None,
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
        push_during_backward: bool = False,
        curve_secret_key: str | None = None,
        curve_server_key: str | None = None,
        units: UnitPlan | None = None,
        push_window_bytes: int = 1 << 30,
        pace_window_bytes: int | None = None,
        same_host_ipc: bool = True,
        connections_per_node: int = 1,
        module: torch.nn.Module | None = None,
        broadcast_buffers: bool = True,
        join_at_step: int | None = None,
        local_size: int = 1,
        node_bandwidths: Sequence[float] | None = None,
        overlap_forward: bool = False,
        keep_step_gradients: bool = True,
        moments: str = "fp32",
        moment_block: int = 256,
    ) -> None:
        validate_for_rule(self.rule, AdamWHyper(float(lr), betas[0], betas[1], 0.0, weight_decay))
        self._setup(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay}, RemoteOptions.from_arguments(locals()))

    def _group_hyper(self, group: dict[str, Any]) -> AdamWHyper:
        beta1, beta2 = group["betas"]
        return AdamWHyper(float(group["lr"]), float(beta1), float(beta2), 0.0, float(group["weight_decay"]))
