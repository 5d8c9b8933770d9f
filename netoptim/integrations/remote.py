"""What the framework integrations share: a torch optimizer replaced by its remote counterpart over
the same parameters and hyperparameters, and the learning-rate schedulers made for it pointed at the
replacement. No framework is imported here."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from gpu_worker import RemoteAdam, RemoteAdamW, RemoteOptimizer, RemoteSGD
from gpu_worker.remote_optimizer import RemoteOptions

IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay", "param_names")
"""Param-group keys of torch's optimizers that choose how torch computes, not what: the nodes run their
own kernels, so they are left out of the remote optimizer's groups."""

REFUSED_FLAGS = ("amsgrad", "maximize")
"""Options of torch's optimizers the nodes do not implement: a group that sets one is refused."""


def remote_class(optimizer: torch.optim.Optimizer) -> type[RemoteOptimizer]:
    """The remote optimizer that applies ``optimizer``'s update rule on the nodes; ``TypeError`` for
    a rule the nodes do not have."""
    if type(optimizer) is torch.optim.AdamW:
        return RemoteAdamW
    if type(optimizer) is torch.optim.Adam:
        return RemoteAdamW if optimizer.defaults.get("decoupled_weight_decay") else RemoteAdam
    if type(optimizer) is torch.optim.SGD:
        return RemoteSGD
    raise TypeError(
        f"netoptim runs torch.optim.AdamW, Adam and SGD on the optimizer nodes, not {type(optimizer).__name__}: "
        "return one of those from configure_optimizers, or a gpu_worker remote optimizer (RemoteAdamW, RemoteAdam, RemoteSGD, RemoteLion)"
    )


def _rule_defaults(cls: type[RemoteOptimizer], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The constructor arguments of ``cls`` taken from a torch optimizer's ``defaults``."""
    if cls is RemoteSGD:
        keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    else:
        keys = ("lr", "betas", "eps", "weight_decay")
    return {key: defaults[key] for key in keys if key in defaults}


def parameter_names(module: nn.Module) -> dict[int, str]:
    """Each parameter of ``module`` by ``id``: its name, as the nodes will know it (shared parameters
    under their first name)."""
    return {id(p): name for name, p in module.named_parameters(remove_duplicate=True)}


REMOTE_OPTIONS = tuple(field.name for field in dataclasses.fields(RemoteOptions))
"""What :func:`to_remote` forwards: the options every remote optimizer takes besides its rule's
hyperparameters (``nodes``, ``rank``, ``world_size``, ``wire_dtype``, ``max_grad_norm``, ``bucket_numel``,
``bucket_layout``, ``timeout_s``, ``connect_timeout_s``, ``heartbeat_s``, ``silent_after_s``,
``reconnect_s``, ``push_during_backward``, ``curve_secret_key``, ``curve_server_key``, ``units``,
``push_window_bytes``, ``pace_window_bytes``, ``same_host_ipc``, ``connections_per_node``, ``module``,
``broadcast_buffers``, ``join_at_step``, ``local_size``, ``node_bandwidths``, ``overlap_forward``,
``keep_step_gradients``), each documented on :class:`~gpu_worker.RemoteAdamW`."""


def to_remote(optimizer: torch.optim.Optimizer, names: Mapping[int, str], **options: Any) -> RemoteOptimizer:
    """A remote optimizer with ``optimizer``'s rule, param groups (every hyperparameter, and whatever a
    scheduler keeps in them, such as ``initial_lr``) and parameters, each under its name in ``names``.
    ``optimizer`` must not have stepped yet: its state would not move (load a state dict for that).

    Args:
        optimizer: a ``torch.optim`` AdamW, Adam or SGD (a remote optimizer is returned as it is).
        names: each parameter's name by ``id`` (:func:`parameter_names`).
        options: forwarded by keyword to the remote optimizer's constructor, unchanged: only the names in
            :data:`REMOTE_OPTIONS` (documented on :class:`~gpu_worker.RemoteAdamW`, with its defaults for
            those not given). The hyperparameters come from ``optimizer``; any other name is a ``TypeError``,
            raised before anything connects.
    """
    unknown = sorted(set(options) - set(REMOTE_OPTIONS))
    if unknown:
        raise TypeError(f"to_remote forwards the remote optimizers' options only ({', '.join(REMOTE_OPTIONS)}), not {', '.join(unknown)}")
    if isinstance(optimizer, RemoteOptimizer):
        return optimizer
    cls = remote_class(optimizer)
    if any(optimizer.state.values()):
        raise ValueError(f"{type(optimizer).__name__} has state already: netoptim takes an optimizer before its first step")
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        refused = [flag for flag in REFUSED_FLAGS if group.get(flag)]
        if refused:
            raise ValueError(f"param group {index} sets {', '.join(refused)}, which the optimizer nodes do not implement")
        unnamed = [p for p in group["params"] if id(p) not in names]
        if unnamed:
            raise ValueError(f"param group {index} holds {len(unnamed)} parameter(s) that are not the model's: netoptim names every parameter it registers")
        kept = {key: value for key, value in group.items() if key not in IMPLEMENTATION_KEYS and key not in REFUSED_FLAGS and key != "params"}
        groups.append({**kept, "params": [(names[id(p)], p) for p in group["params"]]})
    return cls(groups, **_rule_defaults(cls, optimizer.defaults), **options)


def _track_step_calls(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` as torch's learning-rate schedulers do with the optimizer they are made
    for (they warn about the order of ``step()`` calls otherwise)."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    owner = weakref.ref(optimizer)
    step = type(optimizer).step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = owner()
        opt._opt_called = True  # type: ignore[union-attr]
        return step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def rebind_schedulers(schedulers: Iterable[Any], old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Point every scheduler made for ``old`` at ``new`` (whose param groups hold the same values, in
    the same order), so the schedule drives the remote optimizer's groups from the next step on."""
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is old:
            scheduler.optimizer = new
            _track_step_calls(new)


def remote_optimizers(optimizers: Iterable[Any]) -> list[RemoteOptimizer]:
    """The remote optimizers among ``optimizers``, looking through framework wrappers (accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``)."""
    found = []
    for optimizer in optimizers:
        inner = optimizer
        for _ in range(4):  # a wrapper of a wrapper at most, in practice
            if isinstance(inner, RemoteOptimizer):
                found.append(inner)
                break
            inner = getattr(inner, "optimizer", None) or getattr(inner, "_optimizer", None)
    return found
