"""Optimizer state dicts both ways: a run moves from torch AdamW to RemoteAdamW and back at any step
and continues bit for bit, as if it had never moved."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gpu_worker import RemoteAdamW
from tests.gpu_worker.harness import batch, loss_fn, make_model

SAVED_AT, STEPS = 4, 8


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()
        self.unused = nn.Linear(4, 4)  # never called: no gradient, no state in torch either

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def model_with_unused() -> nn.Module:
    return WithUnused()


def groups(model: nn.Module) -> list[dict]:
    decay = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [(n, p) for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 2e-2}]


def torch_adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([{**g, "params": [p for _, p in g["params"]]} for g in groups(model)], lr=1e-2, fused=True)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        loss_fn(model, *batch(step)).backward()
        opt.step()
        opt.zero_grad()


def torch_all_the_way() -> list[torch.Tensor]:
    model = model_with_unused()
    train(model, torch_adamw(model), range(STEPS))
    return [p.detach().clone() for p in model.parameters()]


def test_torch_to_netoptim_continues_bitwise(node):
    model = model_with_unused()
    opt = torch_adamw(model)
    train(model, opt, range(SAVED_AT))
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})

    resumed = model_with_unused()
    resumed.load_state_dict(saved["model"])
    remote = RemoteAdamW(groups(resumed), lr=1e-2, nodes=[node.address], rank=0, world_size=1, bucket_numel=256)
    remote.load_state_dict(saved["opt"])
    train(resumed, remote, range(SAVED_AT, STEPS))
    for expected, actual in zip(torch_all_the_way(), resumed.parameters(), strict=True):
        assert torch.equal(expected, actual)
    remote.close()


def test_netoptim_to_torch_continues_bitwise(node):
    model = model_with_unused()
    remote = RemoteAdamW(groups(model), lr=1e-2, nodes=[node.address], rank=0, world_size=1, bucket_numel=256)
    train(model, remote, range(SAVED_AT))
    saved = remote.state_dict()
    remote.close()
    order = [name for group in groups(model) for name, _ in group["params"]]  # torch's indices: over the groups
    never = [i for i, name in enumerate(order) if name.startswith("unused.")]  # never stepped: step 0, zero moments (torch takes it as no entry)
    assert sorted(saved["state"]) == list(range(len(order)))
    assert all(float(saved["state"][i]["step"]) == 0 and not saved["state"][i]["exp_avg"].any() for i in never)
    assert all(float(entry["step"]) == SAVED_AT for i, entry in saved["state"].items() if i not in never)
    assert saved["netoptim"]["step"] == SAVED_AT

    opt = torch_adamw(model)
    opt.load_state_dict(saved)
    train(model, opt, range(SAVED_AT, STEPS))
    for expected, actual in zip(torch_all_the_way(), model.parameters(), strict=True):
        assert torch.equal(expected, actual)


def test_a_state_dict_of_another_optimizer_is_refused(node):
    model = model_with_unused()
    remote = RemoteAdamW(groups(model), lr=1e-2, nodes=[node.address], rank=0, world_size=1, bucket_numel=256)
    sgd = torch.optim.SGD([{**g, "params": [p for _, p in g["params"]]} for g in groups(model)], lr=0.1, momentum=0.9)
    train(model, sgd, range(1))
    with pytest.raises(ValueError, match=r"state dict of torch's adamw optimizer"):
        remote.load_state_dict(sgd.state_dict())
    with pytest.raises(ValueError, match="more than one parameter group"):  # a parameter it holds already: refused, nothing changed
        remote.add_param_group({"params": [("net.0.weight", model.net[0].weight)]})
    assert len(remote.param_groups) == 2
    remote.close()


def test_step_counts_of_their_own_and_an_added_group_survive_a_node_restart(start_node, tmp_path):
    """A layer unused for the first steps (its own AdamW step count) and a param group added mid-run
    are in the node's checkpoint: a node restarted with --resume continues exactly as torch would."""
    checkpoints = str(tmp_path / "checkpoints")
    torch.manual_seed(0)
    first, second, late = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    modules = [first, second, late]
    reference = copy.deepcopy(modules)

    def loss(layers: list[nn.Module], step: int) -> torch.Tensor:
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        y = layers[0](x) + (layers[1](x) if step >= 2 else 0) + (layers[2](x) if step >= 3 else 0)
        return y.pow(2).mean()

    def named(layers: list[nn.Module], upto: int) -> list[tuple[str, torch.Tensor]]:
        return [(f"m{i}.{n}", p) for i, layer in enumerate(layers[:upto]) for n, p in layer.named_parameters()]

    torch_opt = torch.optim.AdamW([p for _, p in named(reference, 2)], lr=1e-2, fused=True)
    node = start_node("before", extra_args=("--checkpoint-dir", checkpoints))
    remote = RemoteAdamW(named(modules, 2), lr=1e-2, nodes=[node.address], rank=0, world_size=1, bucket_numel=64)
    for step in range(5):
        if step == 3:
            torch_opt.add_param_group({"params": [p for _, p in named(reference, 3)[4:]]})
            remote.add_param_group({"params": named(modules, 3)[4:]})
        if step == 4:  # the node goes down between steps and comes back from its checkpoint
            remote.close()
            assert node.stop() == 0
            node = start_node("after", extra_args=("--checkpoint-dir", checkpoints, "--resume"))
            params = named(modules, 3)
            remote = RemoteAdamW([{"params": params[:4]}, {"params": params[4:]}], lr=1e-2, nodes=[node.address], rank=0, world_size=1, bucket_numel=64)
            assert remote.remote_step == 4
        for layers, opt in ((reference, torch_opt), (modules, remote)):
            loss(layers, step).backward()
            opt.step()
            for layer in layers:
                layer.zero_grad()
    remote.close()
    for expected, actual in zip(named(reference, 3), named(modules, 3), strict=True):
        assert torch.equal(expected[1], actual[1]), expected[0]


def test_torch_distributed_checkpoint_saves_and_loads_model_and_optimizer(node, tmp_path):
    """As with FSDP: get_state_dict / dcp.save, then dcp.load / set_state_dict, from torch AdamW into
    RemoteAdamW; the run continues bitwise. Loading does not run the zero-lr step that initializes an
    empty optimizer state (it would count on the nodes)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = model_with_unused()
    opt = torch_adamw(model)
    train(model, opt, range(SAVED_AT))
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp_path / "dcp"))

    resumed = model_with_unused()
    remote = RemoteAdamW(groups(resumed), lr=1e-2, nodes=[node.address], rank=0, world_size=1, bucket_numel=256)
    model_state, optim_state = get_state_dict(resumed, remote)
    assert remote.remote_step == 0  # no initializing step ran on the nodes
    state = {"model": model_state, "optim": optim_state}
    # The torch run never stepped the unused layer, so its checkpoint has no state for it (torch's own
    # optimizer would need the same partial load): its entries stay at step 0, zero moments.
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(resumed, remote, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train(resumed, remote, range(SAVED_AT, STEPS))
    for expected, actual in zip(torch_all_the_way(), resumed.parameters(), strict=True):
        assert torch.equal(expected, actual)
    remote.close()
