"""Remote optimizers with other update rules than AdamW: drop-ins for ``torch.optim.Adam`` and
``torch.optim.SGD`` (momentum, dampening, Nesterov), and Lion, a rule that keeps one moment instead
of two when the state does not fit. Each takes the options of :class:`~gpu_worker.RemoteAdamW`
(``nodes``, ``rank``, ``world_size``, ``wire_dtype``, ``max_grad_norm``, ...) and behaves like it;
only the update on the nodes differs (see :mod:`optimizer_node.update.rules`). AdamW stays the fast path:
the others update each parameter piece with torch's kernel of the rule, not the one-pass loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from gpu_worker.remote_adamw import TORCH_ADAMW_GROUP_KEYS
from gpu_worker.remote_optimizer import RemoteOptimizer
from netoptim.job.hyper import AdamWHyper, validate_for_rule


class RemoteAdam(RemoteOptimizer):
    """``torch.optim.Adam`` (weight decay as L2 on the gradient) with its state on the nodes;
    bitwise equal to ``torch.optim.Adam(fused=True)`` fed the averaged gradient."""

    rule = "adam"
    torch_group_keys: ClassVar[dict[str, Any]] = {**TORCH_ADAMW_GROUP_KEYS, "decoupled_weight_decay": False}

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        **options: Any,
    ) -> None:
        validate_for_rule(self.rule, AdamWHyper(float(lr), betas[0], betas[1], eps, weight_decay))
        self._setup(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}, **options)


class RemoteSGD(RemoteOptimizer):
    """``torch.optim.SGD`` with momentum, dampening and Nesterov, the momentum buffer on the nodes;
    bitwise equal to ``torch.optim.SGD(fused=True)`` fed the averaged gradient. Momentum and
    dampening must lie in [0, 1)."""

    torch_group_keys: ClassVar[dict[str, Any]] = {"maximize": False, "foreach": None, "differentiable": False, "fused": True}

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        **options: Any,
    ) -> None:
        self.rule = "sgd-nesterov" if nesterov else "sgd"  # one rule per job: every group uses it
        validate_for_rule(self.rule, AdamWHyper(float(lr), momentum, dampening, 0.0, weight_decay))
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay, "nesterov": nesterov}
        self._setup(params, defaults, **options)
        if any(bool(group["nesterov"]) != nesterov for group in self.param_groups):
            raise ValueError("nesterov is one choice for the whole optimizer: every param group must use the constructor's")

    def _group_hyper(self, group: dict[str, Any]) -> AdamWHyper:
        return AdamWHyper(float(group["lr"]), float(group["momentum"]), float(group["dampening"]), 0.0, float(group["weight_decay"]))


class RemoteLion(RemoteOptimizer):
    """Lion (Chen et al., 2023): the sign of an interpolation of momentum and gradient is the update,
    with decoupled weight decay; one moment per parameter. Typical settings: a learning rate 3-10x
    smaller than AdamW's and a weight decay 3-10x larger."""

    rule = "lion"
    torch_group_keys: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        **options: Any,
    ) -> None:
        validate_for_rule(self.rule, AdamWHyper(float(lr), betas[0], betas[1], 0.0, weight_decay))
        self._setup(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay}, **options)

    def _group_hyper(self, group: dict[str, Any]) -> AdamWHyper:
        beta1, beta2 = group["betas"]
        return AdamWHyper(float(group["lr"]), float(beta1), float(beta2), 0.0, float(group["weight_decay"]))
