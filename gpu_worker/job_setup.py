"""A worker's side of a job's description: its rank and width, the options checked against each
other, and the job spec its param groups, units and options make (the layout every rank and node
derives the same buckets from), extended when a param group is added."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from gpu_worker.exchange.forward_waits import check_held
from gpu_worker.layerwise.units import UnitPlan
from gpu_worker.layout import layout_from_groups
from protos.job.placement import default_bucket_numel
from protos.job.spec import JobSpec
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


def check_options(
    *,
    units: UnitPlan | None,
    module: torch.nn.Module | None,
    overlap_forward: bool,
    curve_secret_key: str | None,
    curve_server_key: str | None,
    join_at_step: int | None,
    push_during_backward: bool,
    pace_window_bytes: int | None,
    push_window_bytes: int,
    max_grad_norm: float | None,
) -> None:
    """``ValueError`` for a remote optimizer's options that do not go together, or not with the job's
    mode (``units``: layer-wise); checked before any connection opens, so the nodes never hear of it."""
    if overlap_forward and (units is not None or module is None):
        raise ValueError(
            "overlap_forward needs module= (the model whose forward waits for its parameters' new values) and full-model mode "
            "(layer-wise mode fetches each unit for its forward already)"
        )
    if bool(curve_secret_key) != bool(curve_server_key):
        raise ValueError("curve_secret_key and curve_server_key go together")
    if join_at_step is not None and units is not None:  # a worker joining a running job: the nodes take it, at the new width, from that step
        raise ValueError("a layer-wise job cannot change its width: join_at_step is for full-model jobs")
    if pace_window_bytes is not None:
        if units is not None or not push_during_backward:
            raise ValueError("pace_window_bytes paces the pushes of a full-model worker that pushes during backward (push_during_backward=True)")
        if max_grad_norm is not None:  # no values come back before every gradient is in: a window would wait for ever
            raise ValueError("pace_window_bytes cannot go with max_grad_norm: clipped values come back only once every gradient is in")
    if units is not None and push_window_bytes <= 0:
        raise ValueError(f"push_window_bytes must be positive, got {push_window_bytes}")


def job_from_groups(
    param_groups: Sequence[dict],
    *,
    units: UnitPlan | None,
    num_nodes: int,
    world_size: int,
    bucket_numel: int | None,
    wire_dtype: torch.dtype,
    bucket_layout: int | None = None,
    max_grad_norm: float | None,
    rule: str,
    local_size: int,
    node_bandwidths: Sequence[float] | None,
    moments: str = "fp32",
    moment_block: int = 256,
) -> tuple[JobSpec, list[torch.Tensor]]:
    """The job's spec and its parameters in layout order. Layer-wise (``units``), the layout is
    ordered by unit, each unit in buckets of its own; ``bucket_numel`` ``None`` takes the default
    for the model's size and the node count, ``bucket_layout`` ``None`` the mode's (layer-wise: 2,
    no parameter that fits a bucket split in two; full model: 1)."""
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
        bucket_layout=bucket_layout if bucket_layout is not None else (1 if units is None else 2),
        moments=moments,
        moment_block=moment_block,
    )
    job.validate()  # a bad moments option says so here, before any node hears of the job
    return job, tensors


def extend_job(
    job: JobSpec,
    extend: Callable[[JobSpec, Sequence[torch.Tensor]], object],
    param_groups: list[dict],
    params: Sequence[torch.Tensor],
    *,
    overlap_module: torch.nn.Module | None,
) -> list[torch.Tensor]:
    """A full-model job's parameters in layout order once a param group was added (the last of
    ``param_groups``; ``params``: the parameters of ``job``, the job before it), the nodes told of them
    in new buckets by ``extend(new_job, params)`` (:meth:`OffloadSession.extend`). On a refusal the
    group is taken off ``param_groups`` again."""
    known = {id(p) for p in params}
    specs, tensors = layout_from_groups(param_groups)
    try:
        if any(id(p) in known for p in tensors[len(params) :]) or [id(p) for p in tensors[: len(params)]] != [id(p) for p in params]:
            raise ValueError("the added param group must hold only parameters new to this optimizer")
        if overlap_module is not None:
            check_held(overlap_module, tensors)
        extend(dataclasses.replace(job, params=tuple(specs)), tensors)
    except BaseException:
        param_groups.pop()
        raise
    return tensors
