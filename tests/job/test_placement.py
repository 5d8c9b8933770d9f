"""The placement both sides derive: weighted shares per node."""

from __future__ import annotations

import dataclasses

import pytest

from job.placement import ParamSpec, plan_buckets
from job.spec import JobSpec


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
