"""Gathering a run of buckets with merged copies fills the buffer as bucket-by-bucket gathers do,
and installing received values through views made once per bucket lands every element where the
plain scatter puts it, and follows a parameter whose memory was replaced."""

from __future__ import annotations

import torch

from gpu_worker.layout import InstallTargets, gather_bucket, gather_run, scatter_bucket
from protos.job.placement import ParamSpec, plan_buckets


def _params() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in [(37, 5), (300,), (64, 64), (3,)]]


def _buckets(params: list[torch.Tensor]):
    specs = [ParamSpec(f"p{i}", tuple(p.shape), "float32", 0) for i, p in enumerate(params)]
    return plan_buckets(specs, 256, 1)


def test_installs_equal_the_scatter_whole_or_in_chunks():
    mine, theirs = _params(), _params()
    buckets = _buckets(mine)
    assert any(len(b.segments) > 1 for b in buckets) and any(len(b.segments) == 1 for b in buckets)
    targets = InstallTargets()
    generator = torch.Generator().manual_seed(1)
    for _round in range(2):  # the second round reuses the views made in the first
        for bucket in buckets:
            values = torch.randn(bucket.numel, generator=generator)
            cut = bucket.numel // 3
            for pieces in ([(0, values)], [(0, values[:cut]), (cut, values[cut:])]):
                targets.install(bucket, pieces, mine)
                scatter_bucket(bucket, pieces, theirs)
                assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_a_parameter_whose_memory_was_replaced_gets_the_values():
    params = _params()
    buckets = _buckets(params)
    targets = InstallTargets()
    for bucket in buckets:
        targets.install(bucket, [(0, torch.zeros(bucket.numel))], params)
    replaced = [p.clone() for p in params]
    for param, new in zip(params, replaced, strict=True):
        param.data = new  # as module.to() or a user's param.data = ... does
    for bucket in buckets:
        targets.install(bucket, [(0, torch.ones(bucket.numel))], params)
    assert all(bool((p == 1).all()) for p in params)
    assert all(p.data_ptr() == new.data_ptr() for p, new in zip(params, replaced, strict=True))


def test_a_run_gathers_as_its_buckets_one_by_one_with_casts_and_absent_gradients():
    params = _params()
    buckets = _buckets(params)
    grads: list[torch.Tensor | None] = [torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) for p in params]
    grads[2] = None  # a parameter without a gradient: zeros, as DDP counts it
    for dtype in (torch.float32, torch.bfloat16):
        for run in (buckets, buckets[1:3], buckets[-2:]):
            total = sum(b.numel for b in run)
            merged, one_by_one = torch.full((total,), 7.0, dtype=dtype), torch.full((total,), 7.0, dtype=dtype)
            gather_run(run, grads, merged)
            offset = 0
            for bucket in run:
                gather_bucket(bucket, grads, one_by_one[offset : offset + bucket.numel])
                offset += bucket.numel
            assert torch.equal(
                merged.view(torch.int16 if dtype == torch.bfloat16 else torch.int32), one_by_one.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
            )
