"""The hyperparameters of one bucket's update, as workers send them and nodes apply them."""

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
