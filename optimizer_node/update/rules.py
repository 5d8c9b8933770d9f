"""The update rules other than AdamW's fast path, one parameter piece at a time: each bitwise equal
to its torch counterpart (``fused=True``) fed the averaged gradient, or, for Lion, which torch does
not ship, to the reference implementation in ``tests/optimizer_node/test_rules.py``.

The gradient arrives as the fp32 sum of the ranks' gradients; it is divided by the world size here
first (``grad_divisor``), exactly as the reference averages, then handed to torch's fused kernel.
Slots of :class:`~protos.job.hyper.AdamWHyper` per rule are described in :mod:`protos.job.hyper`.
"""

from __future__ import annotations

import torch

from optimizer_node.update.adamw import fused_adamw
from protos.job.hyper import AdamWHyper


def apply_rule(
    rule: str,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamWHyper,
    grad_divisor: torch.Tensor | None,
) -> None:
    """One step of ``rule`` on one parameter piece, in place; ``step`` (0-d fp32) was already
    incremented for this step (1 on the first). ``grad`` may be overwritten."""
    if rule == "adamw":
        fused_adamw([param], [grad], [exp_avg], [exp_avg_sq], step, hyper, grad_divisor=grad_divisor)
        return
    if grad_divisor is not None:
        grad.div_(grad_divisor)
    if rule == "adam":
        fused_adamw([param], [grad], [exp_avg], [exp_avg_sq], step, hyper, decoupled_weight_decay=False)
    elif rule in ("sgd", "sgd-nesterov"):
        momentum = hyper.beta1
        torch._fused_sgd_(
            [param],
            [grad],
            [exp_avg] if momentum != 0.0 else [],
            weight_decay=hyper.weight_decay,
            momentum=momentum,
            lr=hyper.lr,
            dampening=hyper.beta2,
            nesterov=rule == "sgd-nesterov",
            maximize=False,
            is_first_step=float(step) == 1.0,  # torch: the momentum buffer starts as the gradient itself
            grad_scale=None,
            found_inf=None,
        )
    elif rule == "lion":
        lion_update(param, grad, exp_avg, hyper)
    else:
        raise ValueError(f"unknown update rule {rule!r}")


def lion_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, hyper: AdamWHyper) -> None:
    """Lion: the sign of ``beta1``-interpolated momentum and gradient is the update; decoupled weight
    decay; the momentum then moves toward the gradient with ``beta2``."""
    direction = exp_avg.mul(hyper.beta1).add_(grad, alpha=1.0 - hyper.beta1).sign_()
    param.mul_(1.0 - hyper.lr * hyper.weight_decay)
    param.add_(direction, alpha=-hyper.lr)
    exp_avg.mul_(hyper.beta2).add_(grad, alpha=1.0 - hyper.beta2)
