"""The registration contract between a job's workers and its optimizer nodes.

Rank 0 registers a :class:`JobSpec` with every node; every other rank sends its own and the node
checks that it is identical. Both sides derive the bucket plan from it with
:func:`optimizer_node.placement.plan_buckets`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from optimizer_node.placement import BucketSpec, ParamSpec, first_difference, plan_buckets
from transport.wire import WIRE_DTYPES

MODES = ("full", "layerwise")
"""``full``: every worker holds the whole model and the node sends each bucket's new values to every
worker as soon as it is updated. ``layerwise``: workers hold a window of units and fetch each
bucket when they need it (the node answers a PULL for step ``s`` once the bucket reached ``s``)."""


@dataclass(frozen=True, slots=True)
class JobSpec:
    """Everything the ranks of one job must agree on."""

    world_size: int
    num_nodes: int
    bucket_numel: int
    wire_dtype: str
    max_grad_norm: float | None
    params: tuple[ParamSpec, ...]
    mode: str = "full"
    unit_starts: tuple[int, ...] = ()  # layer-wise: index of each unit's first parameter

    def validate(self) -> None:
        """``ValueError`` for values no job can have."""
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {self.num_nodes}")
        if self.bucket_numel < 1:
            raise ValueError(f"bucket_numel must be >= 1, got {self.bucket_numel}")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype {self.wire_dtype!r} is not one of {sorted(WIRE_DTYPES)}")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a positive number, got {self.max_grad_norm}")
        if not self.params:
            raise ValueError("a job needs at least one parameter")
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {list(MODES)}")
        if list(self.unit_starts) != sorted(set(self.unit_starts)) or any(not 0 <= s < len(self.params) for s in self.unit_starts):
            raise ValueError(f"unit_starts must be increasing parameter indices in [0, {len(self.params)}), got {list(self.unit_starts)}")
        if self.unit_starts and self.mode != "layerwise":
            raise ValueError("unit_starts are for layer-wise jobs only")

    def plan(self) -> list[BucketSpec]:
        return plan_buckets(self.params, self.bucket_numel, self.num_nodes, self.unit_starts)

    def to_wire(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "num_nodes": self.num_nodes,
            "bucket_numel": self.bucket_numel,
            "wire_dtype": self.wire_dtype,
            "max_grad_norm": self.max_grad_norm,
            "params": [spec.to_wire() for spec in self.params],
            "mode": self.mode,
            "unit_starts": list(self.unit_starts),
        }

    @classmethod
    def from_wire(cls, raw: object) -> JobSpec:
        """Parse and validate; ``ValueError`` with the reason for anything malformed."""
        if not isinstance(raw, dict):
            raise ValueError("job spec must be a map")
        try:
            ints = {key: raw[key] for key in ("world_size", "num_nodes", "bucket_numel")}
            wire_dtype = raw["wire_dtype"]
            max_grad_norm = raw["max_grad_norm"]
            params = raw["params"]
        except KeyError as exc:
            raise ValueError(f"job spec lacks {exc.args[0]!r}") from None
        for key, value in ints.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"job spec field {key} must be an integer")
        if not isinstance(wire_dtype, str):
            raise ValueError("job spec field wire_dtype must be a string")
        if max_grad_norm is not None and not isinstance(max_grad_norm, (int, float)):
            raise ValueError("job spec field max_grad_norm must be a number or null")
        if not isinstance(params, list):
            raise ValueError("job spec field params must be a list")
        mode = raw.get("mode", "full")
        unit_starts = raw.get("unit_starts", [])
        if not isinstance(mode, str):
            raise ValueError("job spec field mode must be a string")
        if not isinstance(unit_starts, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in unit_starts):
            raise ValueError("job spec field unit_starts must be a list of integers")
        spec = cls(
            world_size=ints["world_size"],
            num_nodes=ints["num_nodes"],
            bucket_numel=ints["bucket_numel"],
            wire_dtype=wire_dtype,
            max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
            params=tuple(ParamSpec.from_wire(p) for p in params),
            mode=mode,
            unit_starts=tuple(unit_starts),
        )
        spec.validate()
        return spec

    def mismatch(self, other: JobSpec) -> str | None:
        """A sentence describing the first difference from ``other``, or ``None``."""
        if self.mode != other.mode:
            return f"the job was registered in {self.mode} mode, this worker runs in {other.mode} mode; every rank of a job must use the same mode"
        for name in ("world_size", "num_nodes", "bucket_numel", "wire_dtype", "max_grad_norm", "unit_starts"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} differs: registered {mine!r}, got {theirs!r}"
        return first_difference(self.params, other.params)
