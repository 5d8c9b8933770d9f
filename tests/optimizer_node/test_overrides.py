"""An operator's overrides on their own: origins kept per value, a threshold set mid-step waiting
for the next step, what a checkpoint keeps and brings back."""

from __future__ import annotations

import pytest

from optimizer_node.admin.overrides import OperatorOverrides
from optimizer_node.update.adamw import AdamWHyper, HyperOverrides
from protos.job.spec import JobSpec, ParamSpec


def spec(max_grad_norm: float | None, num_nodes: int = 1) -> JobSpec:
    return JobSpec(
        world_size=2, num_nodes=num_nodes, bucket_numel=64, wire_dtype="float32", max_grad_norm=max_grad_norm, params=(ParamSpec("w", (8,), "float32", 0),)
    )


def test_a_value_keeps_its_origin_until_it_changes():
    operator = OperatorOverrides()
    operator.set(HyperOverrides(lr_scale=0.5), origin="first")
    first = operator.origins["lr_scale"]
    operator.set(HyperOverrides(lr_scale=0.5, weight_decay=0.1), origin="second")
    assert operator.origins["lr_scale"] == first and operator.origins["weight_decay"].startswith("second at ")
    assert [entry["name"] for entry in operator.listing()] == ["lr_scale", "weight_decay"]
    assert operator.apply(AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.01)).weight_decay == 0.1
    with pytest.raises(ValueError):
        operator.set(HyperOverrides(lr_scale=-1.0))
    assert operator.hyper == HyperOverrides(lr_scale=0.5, weight_decay=0.1), "a refused override changes nothing"


def test_a_threshold_set_mid_step_waits_for_the_next_step():
    operator, job = OperatorOverrides(), spec(1.0)
    assert operator.max_grad_norm(job) == 1.0 and operator.max_grad_norm(None) is None
    operator.set_max_grad_norm(0.5, job, between_steps=False)
    assert operator.clip_override == 0.5 and operator.max_grad_norm(job) == 1.0, "this step keeps its threshold"
    operator.step_begins()
    assert operator.max_grad_norm(job) == 0.5
    operator.set_max_grad_norm(None, job, between_steps=True)
    assert operator.max_grad_norm(job) == 1.0 and "max_grad_norm" not in operator.origins


@pytest.mark.parametrize(
    ("value", "job", "message"),
    [(0.0, spec(1.0), "positive"), (float("nan"), spec(1.0), "positive"), (1.0, None, "no job"), (1.0, spec(None, num_nodes=2), "switching it on or off")],
)
def test_thresholds_that_cannot_be_used_are_refused(value, job, message):
    with pytest.raises(ValueError, match=message):
        OperatorOverrides().set_max_grad_norm(value, job, between_steps=True)


def test_a_checkpoint_brings_them_back_saying_where_from():
    operator = OperatorOverrides()
    operator.set(HyperOverrides(lr_scale=0.25), origin="netoptim admin set-hparams")
    operator.set_max_grad_norm(2.0, spec(1.0), between_steps=True)
    restored = OperatorOverrides()
    assert restored.restore(operator.to_manifest(), "step-0000000007") == ["lr_scale", "max_grad_norm"]
    assert restored.hyper == operator.hyper and restored.max_grad_norm(spec(1.0)) == 2.0
    assert restored.origins["lr_scale"].endswith(", restored from step-0000000007")
