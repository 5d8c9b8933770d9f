"""The update lane against real nodes: buckets big enough for it (256K elements and more) are updated on
the lane's thread while the loop takes the other ranks' pushes and answers, small ones on the loop's;
the result is bitwise torch's fused AdamW fed the same averaged gradients, in full-model and
layer-wise mode (where the ranks' parameter requests arrive while the lane works), and with the lane
off."""

from __future__ import annotations

import copy

import grpc
import pytest
import torch
from torch import nn

from gpu_worker import RemoteAdamW, offload
from optimizer_node.daemon import LANE_MIN_NUMEL
from protos import admin_pb2, admin_pb2_grpc
from tests.gpu_worker.harness import run_threads

STEPS = 4
WORLD = 2
BUCKET = LANE_MIN_NUMEL  # the weights fill buckets of the lane's size; the biases go in a small one


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 512), nn.Tanh(), nn.Linear(512, 8))


def shard(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(4 * WORLD, 512, generator=generator), torch.randn(4 * WORLD, 8, generator=generator)
    return x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]


def loss_of(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = shard(step, rank)
    return (model(x) - y).pow(2).mean()


def reference() -> list[torch.Tensor]:
    """torch's fused AdamW in one process, fed the ranks' gradients averaged in rank order."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    for step in range(STEPS):
        grads = []
        for rank in range(WORLD):
            replica = copy.deepcopy(model)
            loss_of(replica, step, rank).backward()
            grads.append([p.grad for p in replica.parameters()])
        for index, param in enumerate(model.parameters()):
            param.grad = (grads[0][index] + grads[1][index]) / WORLD
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def train(addresses: list[str], *, layerwise: bool) -> list[torch.Tensor]:
    results: dict[int, list[torch.Tensor]] = {}
    models = [make_model() for _ in range(WORLD)]  # here: the threads would draw from one global generator at once

    def worker(rank: int) -> None:
        model = models[rank]
        options = {"lr": 1e-3, "weight_decay": 0.1, "nodes": addresses, "rank": rank, "world_size": WORLD, "bucket_numel": BUCKET, "timeout_s": 60}
        opt = offload(model, [model[0], model[2]], **options) if layerwise else RemoteAdamW(list(model.named_parameters()), **options)
        for step in range(STEPS):
            loss_of(model, step, rank).backward()
            opt.step()
            opt.zero_grad()
        values = opt.gather_parameters()
        results[rank] = [values[name] for name, _ in model.named_parameters()]
        opt.close()

    run_threads(worker, WORLD)
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1], strict=True))
    return results[0]


def lane_updates(node) -> int:
    with grpc.insecure_channel(node.admin_address) as channel:
        text = admin_pb2_grpc.OptimizerNodeAdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(), timeout=10).update_path
    assert "on the update lane" in text, text
    return int(text.rpartition("; ")[2].split()[0])


@pytest.mark.parametrize("layerwise", [False, True], ids=["full", "layerwise"])
def test_updates_on_the_lane_are_bitwise_torchs(start_node, layerwise):
    expected = reference()
    nodes = [start_node(f"node{i}", extra_args=("--admin", "127.0.0.1:0")) for i in range(2)]
    params = train([node.address for node in nodes], layerwise=layerwise)
    assert all(torch.equal(a, b) for a, b in zip(params, expected, strict=True))
    assert sum(lane_updates(node) for node in nodes) >= STEPS * 3  # the 1.6M weights: at least 3 buckets a step of the lane's size


def test_without_the_lane_the_same_bits(start_node):
    node = start_node(extra_args=("--no-update-lane",))
    params = train([node.address], layerwise=False)
    assert all(torch.equal(a, b) for a, b in zip(params, reference(), strict=True))
