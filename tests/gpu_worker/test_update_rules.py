"""The update rules besides AdamW: each, run on a node for two workers over 20 steps, is bitwise equal
to its torch optimizer (``fused=True``) fed the averaged gradient; Lion to the reference below."""

from __future__ import annotations

import pytest
import torch

from gpu_worker import RemoteAdam, RemoteLion, RemoteSGD
from tests.gpu_worker.harness import RunConfig, reference_averaged, run_offloaded

WORLD_SIZE = 2


class LionReference(torch.optim.Optimizer):
    """Lion as the paper writes it (Chen et al., 2023, Algorithm 2), one parameter at a time:
    c = b1 * m + (1 - b1) * g; p = p * (1 - lr * wd) - lr * sign(c); m = b2 * m + (1 - b2) * g."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                c = m.mul(beta1).add_(p.grad, alpha=1 - beta1)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(c.sign_(), alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


RULES = {
    "adam": (RemoteAdam, lambda groups: torch.optim.Adam(groups, lr=1e-2, weight_decay=0.05, fused=True), {"lr": 1e-2, "weight_decay": 0.05}),
    "sgd": (
        RemoteSGD,
        lambda groups: torch.optim.SGD(groups, lr=5e-2, momentum=0.9, dampening=0.1, weight_decay=0.05, fused=True),
        {"lr": 5e-2, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.05},
    ),
    "sgd-nesterov": (
        RemoteSGD,
        lambda groups: torch.optim.SGD(groups, lr=5e-2, momentum=0.9, weight_decay=0.05, nesterov=True, fused=True),
        {"lr": 5e-2, "momentum": 0.9, "weight_decay": 0.05, "nesterov": True},
    ),
    "lion": (RemoteLion, lambda groups: LionReference(groups, lr=1e-3, weight_decay=0.5), {"lr": 1e-3, "weight_decay": 0.5}),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_rule_is_bitwise_its_torch_optimizer(start_node, rule):
    remote_class, make_reference, options = RULES[rule]
    state_dicts: dict[int, dict] = {}

    def inspect(rank: int, opt) -> None:
        assert opt._session.job.rule == rule
        state_dicts[rank] = opt.state_dict()

    config = RunConfig(world_size=WORLD_SIZE, nodes=[start_node().address], optimizer=remote_class, extra=options, inspect=inspect)
    params, _ = run_offloaded(config)  # checks that every rank ends identical
    expected, _ = reference_averaged(WORLD_SIZE, fused=True, make_optimizer=make_reference)
    for a, b in zip(expected, params, strict=True):
        assert torch.equal(a, b), f"{rule}: max difference {float((a - b).abs().max()):.3g}"
    # Its state dict is the torch optimizer's: a torch run could take it over.
    keys = {"adam": {"step", "exp_avg", "exp_avg_sq"}, "sgd": {"momentum_buffer"}, "sgd-nesterov": {"momentum_buffer"}, "lion": {"exp_avg"}}[rule]
    assert all(set(entry) == keys for entry in state_dicts[0]["state"].values())


def test_rule_arguments_are_checked():
    with pytest.raises(ValueError, match="Nesterov momentum needs"):
        RemoteSGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.0, nesterov=True, nodes=["tcp://127.0.0.1:1"])
    with pytest.raises(ValueError, match="beta1"):
        RemoteLion([torch.nn.Parameter(torch.zeros(2))], betas=(1.5, 0.99), nodes=["tcp://127.0.0.1:1"])
