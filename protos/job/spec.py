"""The registration contract between a job's workers and its optimizer nodes.

Rank 0 registers a :class:`JobSpec` with every node; every other rank sends its own and the node
checks that it is identical. Both sides derive the bucket plan from it with
:func:`protos.job.placement.plan_buckets`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from protos.job.hyper import RULES
from protos.job.moment_formats import DEFAULT_MOMENT_BLOCK, MOMENT_BLOCKS, MOMENT_FORMATS
from protos.job.placement import SPLIT_ALIGNMENT, BucketSpec, ParamSpec, first_difference, plan_buckets
from transport.wire import WIRE_DTYPES

MAX_PARAM_DIMS = 64
"""Dimensions of one parameter's shape at most (a format limit, as torch's own)."""

MAX_NAME_BYTES = 1024
"""UTF-8 bytes of a parameter name at most."""

MAX_DTYPE_CHARS = 32
"""Characters of a parameter's dtype name at most (``bfloat16`` has 8)."""

# The defaults of JobLimits, and of the node flags that set them (--max-job-params, ...).
DEFAULT_MAX_JOB_PARAMS = 1 << 17
DEFAULT_MAX_JOB_ELEMENTS = 1 << 40
DEFAULT_MAX_JOB_BUCKETS = 1 << 17
DEFAULT_MAX_WORLD_SIZE = 1 << 14
DEFAULT_MAX_JOB_NODES = 1 << 12


class LimitError(ValueError):
    """A job over one of a node's limits; ``flag`` is the ``netoptim node`` flag that raises it."""

    def __init__(self, message: str, flag: str) -> None:
        super().__init__(f"{message}; start the node with a higher {flag} to allow it")
        self.flag = flag


@dataclass(frozen=True, slots=True)
class JobLimits:
    """The largest job a node takes: checked on what a HELLO declares, before anything proportional
    to the declared sizes is allocated or iterated (a declared shape is only numbers; planning its
    buckets, or even multiplying out a shape of a million dimensions, is not free)."""

    max_params: int = DEFAULT_MAX_JOB_PARAMS
    """Parameters per job (``--max-job-params``)."""

    max_elements: int = DEFAULT_MAX_JOB_ELEMENTS
    """Elements per job, all parameters together (``--max-job-elements``)."""

    max_buckets: int = DEFAULT_MAX_JOB_BUCKETS
    """Buckets per job (``--max-job-buckets``): the plan costs ~0.4 KB and ~10 us of the node per bucket."""

    max_world_size: int = DEFAULT_MAX_WORLD_SIZE
    """Workers per job (``--max-world-size``)."""

    max_nodes: int = DEFAULT_MAX_JOB_NODES
    """Optimizer nodes per job (``--max-job-nodes``)."""

    def validate(self) -> None:
        """``ValueError`` for a limit that is not a positive integer."""
        for name in ("max_params", "max_elements", "max_buckets", "max_world_size", "max_nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


MODES = ("full", "layerwise")
"""``full``: every worker holds the whole model and the node sends each bucket's new values to every
worker as soon as it is updated. ``layerwise``: workers hold a window of units and fetch each
bucket when they need it (the node answers a PULL for step ``s`` once the bucket reached ``s``)."""
BUCKET_LAYOUTS = (1, 2)
"""How a job cuts its parameters into buckets (:attr:`JobSpec.bucket_layout`)."""


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
    rule: str = "adamw"  # the update rule the nodes apply (protos.job.hyper.RULES)
    # Workers behind each pushing rank (a host group whose gradients it sums first, gpu_worker.host_group):
    # the nodes sum world_size contributions and average over world_size x local_size workers.
    local_size: int = 1
    # Relative share of each node (e.g. its link's bandwidth), for the placement; empty: equal shares.
    node_weights: tuple[float, ...] = ()
    # How parameters are cut into buckets (BUCKET_LAYOUTS): 1, filled to bucket_numel, a parameter
    # split wherever a bucket fills; 2, a parameter that fits in one bucket never split (layer-wise
    # jobs). Part of the spec so that a checkpoint resumes in the layout it was written in.
    bucket_layout: int = 1
    # How the nodes store the moments (MOMENT_FORMATS), and the 8-bit format's elements per scale.
    moments: str = "fp32"
    moment_block: int = DEFAULT_MOMENT_BLOCK

    @property
    def workers(self) -> int:
        """Data-parallel workers in all: the averaging divisor."""
        return self.world_size * self.local_size

    def validate(self) -> None:
        """``ValueError`` for values no job can have."""
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.local_size < 1:
            raise ValueError(f"local_size must be >= 1, got {self.local_size}")
        if self.node_weights and (len(self.node_weights) != self.num_nodes or not all(math.isfinite(w) and w > 0 for w in self.node_weights)):
            raise ValueError(f"node_weights must be {self.num_nodes} positive numbers, one per node, got {list(self.node_weights)}")
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
        if len(self.unit_starts) > len(self.params):  # said before the sort below, whose cost grows with the list
            raise ValueError(f"unit_starts has {len(self.unit_starts)} entries for {len(self.params)} parameters")
        if list(self.unit_starts) != sorted(set(self.unit_starts)) or any(not 0 <= s < len(self.params) for s in self.unit_starts):
            raise ValueError(f"unit_starts must be increasing parameter indices in [0, {len(self.params)}), got {list(self.unit_starts)}")
        if self.unit_starts and self.mode != "layerwise":
            raise ValueError("unit_starts are for layer-wise jobs only")
        if self.rule not in RULES:
            raise ValueError(f"rule {self.rule!r} is not one of {list(RULES)}")
        if type(self.bucket_layout) is not int or self.bucket_layout not in BUCKET_LAYOUTS:  # True and 2.0 compare equal to 1 and 2
            raise ValueError(f"bucket_layout must be one of {list(BUCKET_LAYOUTS)}, got {self.bucket_layout!r}")
        if self.moments not in MOMENT_FORMATS:
            raise ValueError(f"moments {self.moments!r} is not one of {list(MOMENT_FORMATS)}")
        if type(self.moment_block) is not int or self.moment_block not in MOMENT_BLOCKS:
            raise ValueError(f"moment_block must be one of {list(MOMENT_BLOCKS)}, got {self.moment_block!r}")
        if self.moments == "8bit" and self.rule in ("sgd", "sgd-nesterov"):
            raise ValueError("SGD's momentum can be kept in bf16, not in 8 bits: give moments='bf16' or 'fp32'")

    def check_limits(self, limits: JobLimits) -> None:
        """:class:`LimitError` when the job is over ``limits``, ``ValueError`` for a layout no plan
        can have. Costs O(parameters + dimensions), whatever sizes the job declares: every count is
        checked before it is used, and the buckets are counted from below, not planned."""
        if self.workers > limits.max_world_size:
            raise LimitError(f"the job has {self.workers} workers, this node takes at most {limits.max_world_size}", "--max-world-size")
        if self.num_nodes > limits.max_nodes:
            raise LimitError(f"the job has {self.num_nodes} nodes, this node takes jobs of at most {limits.max_nodes}", "--max-job-nodes")
        if len(self.params) > limits.max_params:
            raise LimitError(f"the job has {len(self.params)} parameters, this node takes at most {limits.max_params}", "--max-job-params")
        if self.bucket_numel < SPLIT_ALIGNMENT:
            raise ValueError(f"bucket_numel must be at least {SPLIT_ALIGNMENT}, got {self.bucket_numel}")
        total = 0
        names: set[str] = set()
        for index, param in enumerate(self.params):
            _check_param_format(index, param)
            if param.name in names:
                raise ValueError(f"duplicate parameter name {param.name!r}")
            names.add(param.name)
            # Each dimension is at most max_elements before they are multiplied: a product of at most
            # MAX_PARAM_DIMS such numbers is cheap, one of a million huge ones is not.
            if any(d > limits.max_elements for d in param.shape) or (total := total + param.numel) > limits.max_elements:
                raise LimitError(f"the job declares more than {limits.max_elements:,} elements (at parameter {index})", "--max-job-elements")
        at_least = -(-total // self.bucket_numel)  # the plan can only have more (a bucket ends at each group change)
        if at_least > limits.max_buckets:
            raise LimitError(
                f"{total:,} elements in buckets of {self.bucket_numel:,} make at least {at_least:,} buckets, this node takes at most {limits.max_buckets:,}",
                "--max-job-buckets",
            )

    def plan_within(self, limits: JobLimits) -> list[BucketSpec]:
        """:meth:`plan`, for a job that passed :meth:`check_limits`; :class:`LimitError` for a plan of
        more buckets than ``limits`` allows. The planning is bounded: with at least ``total /
        bucket_numel`` buckets within the limit, it makes at most twice that (every bucket but one per
        parameter and group change holds ``bucket_numel`` rounded down to a multiple of
        ``SPLIT_ALIGNMENT``, at least half of it) plus two per parameter."""
        plan = self.plan()
        if len(plan) > limits.max_buckets:
            raise LimitError(f"the job's plan has {len(plan):,} buckets, this node takes at most {limits.max_buckets:,}", "--max-job-buckets")
        return plan

    def plan(self) -> list[BucketSpec]:
        return plan_buckets(self.params, self.bucket_numel, self.num_nodes, self.unit_starts, self.node_weights, whole_params=self.bucket_layout == 2)

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
            "rule": self.rule,
            **({"local_size": self.local_size} if self.local_size != 1 else {}),
            **({"node_weights": list(self.node_weights)} if self.node_weights else {}),
            **({"bucket_layout": self.bucket_layout} if self.bucket_layout != 1 else {}),
            **({"moments": self.moments} if self.moments != "fp32" else {}),
            **({"moment_block": self.moment_block} if self.moment_block != DEFAULT_MOMENT_BLOCK else {}),
        }

    @classmethod
    def from_wire(cls, raw: object, limits: JobLimits | None = None) -> JobSpec:
        """Parse and validate; ``ValueError`` with the reason for anything malformed. With ``limits``,
        :class:`LimitError` for more parameters than they allow, said before any is parsed (then see
        :meth:`check_limits` for the rest)."""
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
        if limits is not None and len(params) > limits.max_params:
            raise LimitError(f"the job has {len(params)} parameters, this node takes at most {limits.max_params}", "--max-job-params")
        mode = raw.get("mode", "full")
        unit_starts = raw.get("unit_starts", [])
        rule = raw.get("rule", "adamw")
        local_size = raw.get("local_size", 1)
        if not isinstance(local_size, int) or isinstance(local_size, bool):
            raise ValueError("job spec field local_size must be an integer")
        node_weights = raw.get("node_weights", [])
        bucket_layout = raw.get("bucket_layout", 1)  # absent: the layout before there were two
        if not isinstance(bucket_layout, int) or isinstance(bucket_layout, bool):
            raise ValueError("job spec field bucket_layout must be an integer")
        moments = raw.get("moments", "fp32")
        if not isinstance(moments, str):
            raise ValueError("job spec field moments must be a string")
        moment_block = raw.get("moment_block", DEFAULT_MOMENT_BLOCK)
        if not isinstance(moment_block, int) or isinstance(moment_block, bool):
            raise ValueError("job spec field moment_block must be an integer")
        if (
            not isinstance(node_weights, list)
            or len(node_weights) > ints["num_nodes"]
            or not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in node_weights)
        ):
            raise ValueError("job spec field node_weights must be a list of numbers, one per node")
        if not isinstance(mode, str):
            raise ValueError("job spec field mode must be a string")
        if not isinstance(rule, str):
            raise ValueError("job spec field rule must be a string")
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
            rule=rule,
            local_size=local_size,
            node_weights=tuple(float(w) for w in node_weights),
            bucket_layout=bucket_layout,
            moments=moments,
            moment_block=moment_block,
        )
        spec.validate()
        return spec

    def extended_by(self, other: JobSpec) -> bool:
        """Whether ``other`` is this job with parameters added after its own in new param groups (a
        param group added mid-run), so that every bucket of this job keeps its place and node."""
        if other.mode != "full" or self.mode != "full" or len(other.params) <= len(self.params) or other.params[: len(self.params)] != self.params:
            return False
        if any(
            getattr(self, name) != getattr(other, name)
            for name in (
                "rule",
                "world_size",
                "local_size",
                "num_nodes",
                "bucket_numel",
                "wire_dtype",
                "max_grad_norm",
                "bucket_layout",
                "moments",
                "moment_block",
            )
        ):
            return False
        groups = {param.group for param in self.params}
        if any(param.group in groups for param in other.params[len(self.params) :]):
            return False
        mine = self.plan()
        return other.plan()[: len(mine)] == mine

    def mismatch(self, other: JobSpec) -> str | None:
        """A sentence describing the first difference from ``other``, or ``None``."""
        if self.mode != other.mode:
            return f"the job was registered in {self.mode} mode, this worker runs in {other.mode} mode; every rank of a job must use the same mode"
        for name in (
            "rule",
            "world_size",
            "local_size",
            "num_nodes",
            "node_weights",
            "bucket_numel",
            "wire_dtype",
            "max_grad_norm",
            "unit_starts",
            "bucket_layout",
            "moments",
            "moment_block",
        ):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine == theirs:
                continue
            if name in _JOIN_BY_GIVING:  # an optimizer argument whose default may differ from the job's
                return f"{name} differs: registered {mine}, got {theirs}{_JOIN_BY_GIVING[name]}; give the optimizer {name}={mine} to join this job"
            return f"{name} differs: registered {mine!r}, got {theirs!r}"
        return first_difference(self.params, other.params)


_JOIN_BY_GIVING = {
    "moments": "",  # RemoteAdamW(moments=...)
    "moment_block": "",
    "bucket_numel": "",  # RemoteAdamW's default follows the model's size and the node count
    "bucket_layout": " (the job was started by a netoptim that cut its buckets another way, e.g. a checkpoint resumed)",
}
"""Spec fields a worker sets through an optimizer argument, and why one may differ: the mismatch says
which value to give."""


def _check_param_format(index: int, param: ParamSpec) -> None:
    """``ValueError`` for a parameter spec no model has: a name, dtype or shape beyond the format's limits."""
    if len(param.shape) > MAX_PARAM_DIMS:
        raise ValueError(f"parameter {index} has {len(param.shape)} dimensions, at most {MAX_PARAM_DIMS} are allowed")
    if len(param.name) > MAX_NAME_BYTES or len(param.name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise ValueError(f"the name of parameter {index} is longer than {MAX_NAME_BYTES} bytes")
    if len(param.dtype) > MAX_DTYPE_CHARS:
        raise ValueError(f"the dtype of parameter {index} is longer than {MAX_DTYPE_CHARS} characters")
