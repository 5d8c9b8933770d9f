"""Which optimizer node owns which bucket of which parameter: one pure function, used by workers
and nodes alike so both derive the same plan from the same layout.

Parameters are packed, in the order given, into flat buckets of at most ``bucket_numel`` elements.
A bucket never spans two param groups (a bucket is updated with one set of hyperparameters); a
parameter larger than a bucket is split over several, at multiples of ``SPLIT_ALIGNMENT`` elements.
That alignment is what keeps the node's update bitwise equal to ``torch.optim.AdamW(fused=True)``:
the fused CPU kernel runs each tensor's last ``numel % vector_width`` elements through a scalar path
that can round differently from the vector path, so every piece of a split parameter but the last
must be a whole number of vectors, and the node calls the kernel on each segment as its own tensor. Buckets go to nodes greedily, each to the node
with the fewest elements so far (ties to the lower index), which balances bytes while spreading
consecutive buckets, hence consecutive layers, over all nodes.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

SPLIT_ALIGNMENT = 64
"""Parameters are split only at multiples of this many elements (a multiple of any SIMD width)."""


DEFAULT_BUCKET_NUMEL = 1 << 22
"""Elements per bucket of a large model: 16 MiB of fp32 (torch DDP's default buckets hold 25 MB). On a
GPU host a 1.0B model trained 1.15-1.45x faster in these than in 1M-element buckets
(docs/performance.md): a quarter of the per-bucket work on the worker and the node, for a little less
overlap at the end of backward."""

SMALLEST_DEFAULT_BUCKET_NUMEL = 1 << 20
MIN_BUCKETS_PER_NODE = 16
"""The default bucket is halved (down to 1M elements) until each node gets this many: with fewer, the
greedy placement leaves the nodes' shares uneven (one bucket more is 1/16 more work) and a node's
updates overlap backward less."""


def default_bucket_numel(total_numel: int, num_nodes: int) -> int:
    """``bucket_numel`` when none is given, for ``total_numel`` parameters over ``num_nodes`` nodes:
    :data:`DEFAULT_BUCKET_NUMEL`, halved while the nodes would get fewer than
    :data:`MIN_BUCKETS_PER_NODE` buckets each, but never below 1M elements. Every rank derives the
    same from the same model and node list."""
    numel = DEFAULT_BUCKET_NUMEL
    while numel > SMALLEST_DEFAULT_BUCKET_NUMEL and total_numel < numel * MIN_BUCKETS_PER_NODE * max(1, num_nodes):
        numel //= 2
    return numel


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """What every rank must agree on about one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    group: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_wire(self) -> list:
        return [self.name, list(self.shape), self.dtype, self.group]

    @classmethod
    def from_wire(cls, raw: Sequence) -> ParamSpec:
        if not (isinstance(raw, (list, tuple)) and len(raw) == 4):
            raise ValueError(f"a parameter spec is [name, shape, dtype, group], got {raw!r}")
        name, shape, dtype, group = raw
        if not isinstance(name, str) or not isinstance(dtype, str) or not isinstance(group, int):
            raise ValueError(f"bad parameter spec {raw!r}")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"bad shape in parameter spec {raw!r}")
        return cls(name, tuple(shape), dtype, group)


@dataclass(frozen=True, slots=True)
class Segment:
    """A contiguous piece of one parameter inside one bucket."""

    param_index: int
    param_offset: int  # element offset in the flattened parameter
    bucket_offset: int  # element offset in the bucket
    numel: int


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """One unit of transfer and update."""

    bucket_id: int
    group: int
    numel: int
    node: int
    segments: tuple[Segment, ...]


def plan_buckets(
    params: Sequence[ParamSpec],
    bucket_numel: int,
    num_nodes: int,
    unit_starts: Sequence[int] = (),
    node_weights: Sequence[float] = (),
    *,
    whole_params: bool = False,
) -> list[BucketSpec]:
    """Split ``params`` into buckets and assign each to one of ``num_nodes`` nodes.

    ``unit_starts`` are parameter indices where a new bucket must begin (the first parameter of each
    layer-wise unit), so that a unit's parameters travel in buckets of their own. A bucket also ends
    wherever the param group changes, so groups may interleave (layer-wise jobs order parameters by
    unit). ``node_weights`` (one per node, positive; empty: all equal) weighs each node's share, for
    example by its link's bandwidth: a bucket goes to the node whose elements divided by its weight are
    fewest, so a node twice as fast holds (and moves) about twice as many. With ``whole_params`` a
    parameter that fits in one bucket never spans two (the bucket before it closes early): a
    layer-wise CPU worker then computes on every such parameter as a view of the node's board,
    where one split in two is copied out of it. Deterministic in its inputs. Raises ``ValueError``
    for a non-positive size or node count, for duplicate parameter names, for unit starts out of
    range, or for weights that are not one positive number per node.
    """
    if node_weights and (len(node_weights) != num_nodes or not all(math.isfinite(w) and w > 0 for w in node_weights)):
        raise ValueError(f"node_weights must be {num_nodes} positive numbers, one per node, got {list(node_weights)}")
    if bucket_numel < SPLIT_ALIGNMENT:
        raise ValueError(f"bucket_numel must be at least {SPLIT_ALIGNMENT}, got {bucket_numel}")
    if num_nodes <= 0:
        raise ValueError(f"num_nodes must be positive, got {num_nodes}")
    seen: set[str] = set()
    for spec in params:
        if spec.name in seen:
            raise ValueError(f"duplicate parameter name {spec.name!r}")
        seen.add(spec.name)
    if any(not 0 <= start < len(params) for start in unit_starts):
        raise ValueError(f"unit starts {list(unit_starts)} must be parameter indices in [0, {len(params)})")
    raw_buckets: list[tuple[int, int, list[Segment]]] = []  # (group, numel, segments)
    current: list[Segment] = []
    current_numel = 0
    current_group = params[0].group if params else 0

    def close_bucket() -> None:
        nonlocal current, current_numel
        if current:
            raw_buckets.append((current_group, current_numel, current))
        current, current_numel = [], 0

    boundaries = set(unit_starts)
    for index, spec in enumerate(params):
        if spec.group != current_group or index in boundaries:
            close_bucket()
            current_group = spec.group
        if whole_params and current and spec.numel <= bucket_numel and current_numel + spec.numel > bucket_numel:
            close_bucket()
        offset = 0
        while offset < spec.numel:
            space = bucket_numel - current_numel
            remaining = spec.numel - offset
            take = remaining if remaining <= space else space - space % SPLIT_ALIGNMENT
            if take == 0:
                close_bucket()
                continue
            current.append(Segment(index, offset, current_numel, take))
            current_numel += take
            offset += take
    close_bucket()

    # The node with the fewest elements, ties to the lower index: a heap of (load, node) pops exactly
    # that one, in O(log nodes) per bucket rather than a scan of every node.
    if not node_weights:
        load = [(0, node) for node in range(min(num_nodes, len(raw_buckets)))]  # nodes past the bucket count get nothing
        buckets = []
        for bucket_id, (group, numel, segments) in enumerate(raw_buckets):
            total, node = load[0]
            heapq.heapreplace(load, (total + numel, node))
            buckets.append(BucketSpec(bucket_id, group, numel, node, tuple(segments)))
        return buckets
    # Weighted: the node whose load after taking the bucket, over its weight, is least (ties to the lower index).
    totals = [0] * num_nodes
    buckets = []
    for bucket_id, (group, numel, segments) in enumerate(raw_buckets):
        node = min(range(num_nodes), key=lambda n: ((totals[n] + numel) / node_weights[n], n))
        totals[node] += numel
        buckets.append(BucketSpec(bucket_id, group, numel, node, tuple(segments)))
    return buckets


def first_difference(expected: Sequence[ParamSpec], actual: Sequence[ParamSpec]) -> str | None:
    """A sentence naming the first parameter where two layouts differ, or ``None`` if they agree."""
    for index, (want, have) in enumerate(zip(expected, actual, strict=False)):
        if want != have:
            return (
                f"parameter {index} differs: registered {want.name!r} shape {list(want.shape)} {want.dtype} group {want.group}, "
                f"got {have.name!r} shape {list(have.shape)} {have.dtype} group {have.group}"
            )
    if len(expected) != len(actual):
        index = min(len(expected), len(actual))
        longer = expected if len(expected) > len(actual) else actual
        side = "registered layout" if longer is expected else "this worker"
        return f"parameter counts differ ({len(expected)} registered, {len(actual)} here); first extra in {side}: {index} {longer[index].name!r}"
    return None
