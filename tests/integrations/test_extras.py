"""The integrations without a training run: a missing framework fails with the install command, the
package imports no framework, and a torch optimizer becomes its remote counterpart with the same
groups, hyperparameters and scheduler (and a framework's wrapper of it, collected, leaves it open)."""

from __future__ import annotations

import gc
import importlib
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from gpu_worker import RemoteAdam, RemoteAdamW, RemoteSGD
from netoptim.integrations.remote import parameter_names, rebind_schedulers, remote_optimizers, to_remote
from tests.integrations.common import ROOT


@pytest.mark.parametrize(
    ("module", "framework"),
    [
        ("netoptim.integrations.huggingface", "transformers"),
        ("netoptim.integrations.hf_accelerate", "accelerate"),
        ("netoptim.integrations.lightning", "lightning"),
    ],
)
def test_a_missing_framework_fails_naming_the_extra(monkeypatch, module, framework):
    """(e) Importing an integration without its framework raises ImportError with the pip extra."""
    monkeypatch.setitem(sys.modules, framework, None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=rf"needs the package '{framework}', which is not installed: pip install 'netoptim-train\[integrations\]'"):
        importlib.import_module(module)


def test_the_package_imports_no_framework():
    code = "import netoptim.integrations, netoptim.integrations.remote, sys; print(sorted({'transformers', 'accelerate', 'lightning'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def two_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


CONVERSIONS = [
    (lambda groups: torch.optim.AdamW(groups, lr=3e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.2, fused=True), RemoteAdamW),
    (lambda groups: torch.optim.Adam(groups, lr=3e-3, weight_decay=0.01), RemoteAdam),
    (lambda groups: torch.optim.Adam(groups, lr=3e-3, weight_decay=0.01, decoupled_weight_decay=True), RemoteAdamW),
    (lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True), RemoteSGD),
]
KEPT = ("lr", "initial_lr", "betas", "eps", "weight_decay", "momentum", "nesterov")


def test_a_torch_optimizer_becomes_its_remote_counterpart(node):
    """AdamW, Adam (with and without decoupled weight decay) and SGD, one job after another on one node:
    groups, per-group values and the scheduler's ``initial_lr`` carry over, each parameter under its
    module name; the scheduler then drives the remote optimizer, without torch's order warning."""
    for make, remote in CONVERSIONS:
        model = two_layers()
        groups = [{"params": [model[0].weight, model[2].weight]}, {"params": [model[0].bias, *model[1].parameters(), model[2].bias], "lr": 1e-3}]
        local = make(groups)
        schedule = torch.optim.lr_scheduler.LambdaLR(local, lambda step: 0.5**step)
        converted = to_remote(local, parameter_names(model), nodes=[node.address], rank=0, world_size=1, timeout_s=30)
        try:
            assert type(converted) is remote
            rebind_schedulers([schedule], local, converted)
            assert schedule.optimizer is converted and remote_optimizers([local, converted]) == [converted]
            for before, after in zip(local.param_groups, converted.param_groups, strict=True):
                assert [id(p) for p in before["params"]] == [id(p) for p in after["params"]]
                assert {k: v for k, v in before.items() if k in KEPT} == {k: v for k, v in after.items() if k in KEPT}
            assert converted.param_groups[1]["param_names"] == ["0.bias", "1.weight", "1.bias", "2.bias"]
            model(torch.randn(3, 4)).sum().backward()
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # "Detected call of lr_scheduler.step() before optimizer.step()" and its kin
                converted.step()
                schedule.step()
            assert [g["lr"] for g in converted.param_groups] == [g["initial_lr"] * 0.5 for g in converted.param_groups]
            # Lightning wraps an optimizer in a subclass of its class made from a copy of its __dict__, and
            # drops such wrappers as it goes: collecting one must not close the optimizer's connections.
            wrapper = object.__new__(type("LightningWrapper", (type(converted),), {}))
            wrapper.__dict__ = dict(converted.__dict__)
            del wrapper
            gc.collect()
            converted.step()
            assert converted.remote_step == 2
        finally:
            converted.close()


def test_what_the_nodes_do_not_implement_is_refused():
    model = two_layers()
    with pytest.raises(TypeError, match=r"runs torch\.optim\.AdamW, Adam and SGD on the optimizer nodes, not RMSprop"):
        to_remote(torch.optim.RMSprop(model.parameters()), parameter_names(model))
    with pytest.raises(ValueError, match="param group 0 sets amsgrad"):
        to_remote(torch.optim.AdamW(model.parameters(), amsgrad=True), parameter_names(model))
    with pytest.raises(ValueError, match="1 parameter"):
        to_remote(torch.optim.AdamW([*model.parameters(), nn.Parameter(torch.zeros(2))]), parameter_names(model))
