"""The placement both sides derive: weighted shares per node."""

from __future__ import annotations

import dataclasses

import pytest

from protos.job.placement import ParamSpec, plan_buckets
from protos.job.spec import JobSpec


def params(count: int, numel: int = 1024) -> list[ParamSpec]:
    return [ParamSpec(f"p{i}", (numel,), "float32", 0) for i in range(count)]


def test_weights_give_nodes_shares_in_proportion():
    plan = plan_buckets(params(16), 1024, 2, node_weights=(3.0, 1.0))
    assert [sum(1 for b in plan if b.node == n) for n in range(2)] == [12, 4]


def test_equal_weights_give_the_plan_without_weights():
    assert plan_buckets(params(10, 700), 1024, 3, node_weights=(2.0, 2.0, 2.0)) == plan_buckets(params(10, 700), 1024, 3)


@pytest.mark.parametrize("weights", [(1.0,), (1.0, 0.0), (1.0, float("nan"))])
def test_weights_must_be_one_positive_number_per_node(weights):
    with pytest.raises(ValueError, match="node_weights must be 2 positive numbers"):
        plan_buckets(params(4), 1024, 2, node_weights=weights)


def test_job_spec_carries_the_weights_over_the_wire():
    spec = JobSpec(world_size=2, num_nodes=2, bucket_numel=1024, wire_dtype="float32", max_grad_norm=None, params=tuple(params(3)), node_weights=(2.5, 1.0))
    assert JobSpec.from_wire(spec.to_wire()) == spec
    assert "node_weights" not in JobSpec.from_wire({**spec.to_wire(), "node_weights": []}).to_wire()
    with pytest.raises(ValueError, match="node_weights"):
        JobSpec.from_wire({**spec.to_wire(), "node_weights": ["fast", 1]})


def test_a_different_bucket_size_is_refused_with_the_size_to_give():
    registered = JobSpec(world_size=1, num_nodes=1, bucket_numel=1 << 20, wire_dtype="float32", max_grad_norm=None, params=tuple(params(3)))
    joining = dataclasses.replace(registered, bucket_numel=1 << 22)
    assert registered.mismatch(joining) == "bucket_numel differs: registered 1048576, got 4194304; give the optimizer bucket_numel=1048576 to join this job"
    assert registered.mismatch(dataclasses.replace(registered, world_size=2)) == "world_size differs: registered 1, got 2"


def test_whole_params_close_a_bucket_before_a_parameter_that_fits_one():
    specs = [ParamSpec(f"p{i}", (numel,), "float32", 0) for i, numel in enumerate([3000, 3000, 9000, 100, 4096, 64])]
    split = plan_buckets(specs, 4096, 1)
    whole = plan_buckets(specs, 4096, 1, whole_params=True)
    pieces = {index: [] for index in range(len(specs))}
    for bucket in whole:
        assert bucket.numel == sum(s.numel for s in bucket.segments) <= 4096
        for segment in bucket.segments:
            pieces[segment.param_index].append((segment.param_offset, segment.numel))
    for index, spec in enumerate(specs):  # every element once, in order
        offsets = sorted(pieces[index])
        assert [o for o, _ in offsets] == [sum(n for _, n in offsets[:k]) for k in range(len(offsets))] and sum(n for _, n in offsets) == spec.numel
        if spec.numel <= 4096:
            assert len(offsets) == 1, f"{spec.name} fits a bucket, yet spans {len(offsets)}"
    assert len(pieces[2]) == 3, "a parameter larger than a bucket is split as before"
    assert any(len([s for b in split for s in b.segments if s.param_index == i]) > 1 for i in (1, 4)), "without it, the same parameters split"


def test_the_bucket_layout_travels_over_the_wire_and_a_spec_without_it_is_layout_1():
    layered = JobSpec(world_size=1, num_nodes=1, bucket_numel=4096, wire_dtype="float32", max_grad_norm=None, params=tuple(params(5, 3000)), bucket_layout=2)
    assert JobSpec.from_wire(layered.to_wire()) == layered
    assert [b.numel for b in layered.plan()] == [3000] * 5
    earlier = dataclasses.replace(layered, bucket_layout=1)
    assert "bucket_layout" not in earlier.to_wire() and JobSpec.from_wire(earlier.to_wire()).bucket_layout == 1
    assert earlier.mismatch(layered) == (
        "bucket_layout differs: registered 1, got 2 (the job was started by a netoptim that cut its buckets another way, e.g. a checkpoint "
        "resumed); give the optimizer bucket_layout=1 to join this job"
    )
    for bad in (3, True, "2"):
        with pytest.raises(ValueError, match="bucket_layout"):
            JobSpec.from_wire({**layered.to_wire(), "bucket_layout": bad})
    for bad in (True, 2.0):  # equal to 1 and 2, but not layouts: a worker's own spec is refused before it registers
        with pytest.raises(ValueError, match="bucket_layout must be one of"):
            dataclasses.replace(layered, bucket_layout=bad).validate()
