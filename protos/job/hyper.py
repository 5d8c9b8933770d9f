"""The hyperparameters of one bucket's update, as workers send them and nodes apply them, and the
update rules a node runs.

Every rule takes five numbers, in AdamW's slots: ``lr``, ``beta1``, ``beta2``, ``eps`` and
``weight_decay``. What the slots mean per rule:

* ``adamw``: as named (decoupled weight decay), ``torch.optim.AdamW``;
* ``adam``: as named, weight decay as L2 added to the gradient, ``torch.optim.Adam``;
* ``sgd``, ``sgd-nesterov``: ``beta1`` is the momentum, ``beta2`` the dampening, ``eps`` unused
  (0), ``torch.optim.SGD`` (``nesterov=True`` for the second: momentum > 0 and no dampening);
* ``lion``: ``beta1`` interpolates the update's sign, ``beta2`` the momentum, ``eps`` unused;
  decoupled weight decay (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms").
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdamWHyper:
    """Hyperparameters of one bucket's update at one step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    def validate(self) -> None:
        """``ValueError`` naming the first invalid value, with the same bounds as ``torch.optim.AdamW``."""
        if not (math.isfinite(self.lr) and self.lr >= 0.0):
            raise ValueError(f"invalid learning rate {self.lr}: must be finite and >= 0")
        for name, beta in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"invalid {name} {beta}: must be in [0, 1)")
        if not (math.isfinite(self.eps) and self.eps >= 0.0):
            raise ValueError(f"invalid eps {self.eps}: must be finite and >= 0")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0.0):
            raise ValueError(f"invalid weight_decay {self.weight_decay}: must be finite and >= 0")

    def to_wire(self) -> list[float]:
        return [self.lr, self.beta1, self.beta2, self.eps, self.weight_decay]

    @classmethod
    def from_wire(cls, raw: object) -> AdamWHyper:
        if not (isinstance(raw, (list, tuple)) and len(raw) == 5 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in raw)):
            raise ValueError(f"hyperparameters are [lr, beta1, beta2, eps, weight_decay], got {raw!r}")
        hyper = cls(*(float(x) for x in raw))
        hyper.validate()
        return hyper


RULES = ("adamw", "adam", "sgd", "sgd-nesterov", "lion")
"""The update rules a node runs; AdamW is the fast path (the compiled one-pass loop)."""

MOMENT_STATE = {"adamw": 2, "adam": 2, "sgd": 1, "sgd-nesterov": 1, "lion": 1}
"""How many fp32 moments each rule keeps per parameter (SGD's momentum buffer, Lion's momentum)."""


def validate_for_rule(rule: str, hyper: AdamWHyper) -> None:
    """``ValueError`` for hyperparameters ``rule`` cannot take (after :meth:`AdamWHyper.validate`)."""
    if rule not in RULES:
        raise ValueError(f"update rule {rule!r} is not one of {list(RULES)}")
    hyper.validate()
    if rule == "sgd-nesterov" and (hyper.beta1 <= 0.0 or hyper.beta2 != 0.0):
        raise ValueError(f"Nesterov momentum needs a momentum > 0 and zero dampening, got momentum {hyper.beta1} and dampening {hyper.beta2}")
