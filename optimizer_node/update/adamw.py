"""The optimizer math of a node: AdamW on flat fp32 buckets and global-norm clipping.

No I/O here. The update calls torch's fused CPU AdamW kernel, the same kernel as
``torch.optim.AdamW(fused=True)``, so a bucket updated here is bitwise equal to that optimizer fed the
same averaged gradient, provided each parameter's piece is passed to the kernel as a tensor of its
own (see ``segments`` and :mod:`protos.job.placement`); the averaging (division by the number of workers) happens inside the kernel
through its ``grad_scale`` argument, which divides and so is bitwise equal to dividing beforehand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protos.job.hyper import AdamWHyper

CLIP_EPS = 1e-6
"""The epsilon ``torch.nn.utils.clip_grad_norm_`` adds to the norm."""


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamWHyper,
    *,
    segments: Sequence[tuple[int, int]] | None = None,
    grad_divisor: torch.Tensor | None = None,
) -> None:
    """One AdamW step in place on flat fp32 tensors; ``step`` is the 0-d fp32 step count, incremented here.

    ``segments`` are ``(offset, numel)`` pieces updated as separate tensors (one per parameter piece,
    for bitwise equality with torch's per-parameter update); default: the whole tensor at once.
    ``grad_divisor`` (a 0-d fp32 tensor), when given, divides the gradient inside the kernel.
    ``grad`` may be overwritten.
    """
    pieces = segments if segments is not None else [(0, param.numel())]

    def split(tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor[offset : offset + numel] for offset, numel in pieces]

    step.add_(1)
    fused_adamw(split(param), split(grad), split(exp_avg), split(exp_avg_sq), step, hyper, grad_divisor=grad_divisor)


def fused_adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step: torch.Tensor,
    hyper: AdamWHyper,
    *,
    grad_divisor: torch.Tensor | None = None,
    decoupled_weight_decay: bool = True,
) -> None:
    """torch's fused AdamW kernel on lists of fp32 tensors, all at step ``step`` (not incremented here);
    each tensor is one call of the kernel, whose scalar tail is that tensor's last elements. With
    ``decoupled_weight_decay=False``, torch's fused Adam kernel (weight decay as L2 on the gradient)."""
    kernel = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
    kernel(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        [step] * len(params),
        lr=hyper.lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        amsgrad=False,
        maximize=False,
        grad_scale=grad_divisor,
        found_inf=None,
    )


def sum_of_squares(grad: torch.Tensor) -> float:
    """Sum of squares of a gradient bucket, accumulated in fp64 so partial sums combine exactly enough."""
    return float(torch.linalg.vector_norm(grad, dtype=torch.float64) ** 2)


def clip_coefficient(total_sum_of_squares: float, max_norm: float) -> tuple[float, torch.Tensor]:
    """The global norm and the factor ``torch.nn.utils.clip_grad_norm_`` would multiply gradients by.

    Mirrors its fp32 arithmetic: ``min(max_norm / (norm + 1e-6), 1)`` with ``norm`` an fp32 scalar.
    """
    total_norm = torch.tensor(math.sqrt(total_sum_of_squares), dtype=torch.float32)
    coefficient = torch.clamp(max_norm / (total_norm + CLIP_EPS), max=1.0)
    return float(total_norm), coefficient


@dataclass(frozen=True, slots=True)
class HyperOverrides:
    """An operator's changes to the hyperparameters the workers send; ``None`` keeps the worker's value."""

    lr: float | None = None
    lr_scale: float | None = None
    beta1: float | None = None
    beta2: float | None = None
    eps: float | None = None
    weight_decay: float | None = None

    def validate(self) -> None:
        """``ValueError`` naming the first invalid value."""
        if self.lr_scale is not None and not (math.isfinite(self.lr_scale) and self.lr_scale >= 0.0):
            raise ValueError(f"invalid lr_scale {self.lr_scale}: must be finite and >= 0")
        AdamWHyper(
            self.lr if self.lr is not None else 0.0,
            self.beta1 if self.beta1 is not None else 0.0,
            self.beta2 if self.beta2 is not None else 0.0,
            self.eps if self.eps is not None else 0.0,
            self.weight_decay if self.weight_decay is not None else 0.0,
        ).validate()

    def to_dict(self) -> dict[str, float]:
        """The overrides that are set, by name (for checkpoints)."""
        return {name: value for name in self.__slots__ if (value := getattr(self, name)) is not None}

    def apply(self, sent: AdamWHyper) -> AdamWHyper:
        """The hyperparameters to use for an update whose workers sent ``sent`` (``sent`` itself
        where nothing is overridden: once a bucket, on the node's hot path)."""
        if self.lr is None and self.lr_scale is None and self.beta1 is None and self.beta2 is None and self.eps is None and self.weight_decay is None:
            return sent
        lr = sent.lr if self.lr is None else self.lr
        if self.lr_scale is not None:
            lr *= self.lr_scale
        return AdamWHyper(
            lr,
            sent.beta1 if self.beta1 is None else self.beta1,
            sent.beta2 if self.beta2 is None else self.beta2,
            sent.eps if self.eps is None else self.eps,
            sent.weight_decay if self.weight_decay is None else self.weight_decay,
        )
