"""A worker's side of a job's description: its rank and width, and the job spec its param groups,
units and options make (the layout every rank and node derives the same buckets from)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from gpu_worker.layout import layout_from_groups
from gpu_worker.units import UnitPlan
from job.placement import default_bucket_numel
from job.spec import JobSpec
from transport.wire import dtype_name


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``rank`` and ``world_size`` as given, else torch.distributed's, else ``RANK`` and
    ``WORLD_SIZE`` from the environment (torchrun's), else 0 of 1."""
    if rank is not None and world_size is not None:
        return rank, world_size
    if dist.is_available() and dist.is_initialized():
        return (dist.get_rank() if rank is None else rank), (dist.get_world_size() if world_size is None else world_size)
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    try:
        resolved_rank = rank if rank is not None else int(env_rank or 0)
        resolved_world = world_size if world_size is not None else int(env_world or 1)
    except ValueError:
        raise ValueError(f"RANK={env_rank!r} and WORLD_SIZE={env_world!r} must be integers") from None
    return resolved_rank, resolved_world


def job_from_groups(
    param_groups: Sequence[dict],
    *,
    units: UnitPlan | None,
    num_nodes: int,
    world_size: int,
    bucket_numel: int | None,
    wire_dtype: torch.dtype,
    max_grad_norm: float | None,
    rule: str,
    local_size: int,
    node_bandwidths: Sequence[float] | None,
) -> tuple[JobSpec, list[torch.Tensor]]:
    """The job's spec and its parameters in layout order. Layer-wise (``units``), the layout is
    ordered by unit, each unit in buckets of its own; ``bucket_numel`` ``None`` takes the default
    for the model's size and the node count."""
    specs, tensors = layout_from_groups(param_groups)
    unit_starts: list[int] = []
    if units is not None:
        order, unit_starts = units.order(tensors)
        specs, tensors = [specs[i] for i in order], [tensors[i] for i in order]
    if bucket_numel is None:
        bucket_numel = default_bucket_numel(sum(spec.numel for spec in specs), num_nodes)
    job = JobSpec(
        world_size=world_size,
        num_nodes=num_nodes,
        bucket_numel=bucket_numel,
        wire_dtype=dtype_name(wire_dtype),
        max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
        params=tuple(specs),
        mode="full" if units is None else "layerwise",
        unit_starts=tuple(unit_starts),
        rule=rule,
        local_size=local_size,
        node_weights=tuple(float(b) for b in node_bandwidths) if node_bandwidths else (),
    )
    return job, tensors
