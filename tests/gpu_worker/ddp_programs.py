"""Training programs run by ``test_torch_semantics`` in two real processes (gloo), once as torch does it
(DDP or an explicit all-reduce, then ``torch.optim.AdamW``) and once with ``RemoteAdamW``; each saves
rank 0's and rank 1's parameters and buffers for the test to compare bit for bit.

Every scenario uses the standard param-group recipe (no weight decay on norms and biases, its own
learning rate) with a scheduler driving each group.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

STEPS = 8
WORLD_SIZE = 2
PER_RANK = 4


class Branches(nn.Module):
    """A trunk and head every rank uses, a branch no rank ever uses, one only rank 1 uses."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh())
        self.head = nn.Linear(16, 3)
        self.never = nn.Linear(16, 3)  # no rank calls it: torch leaves it alone
        self.rank1_only = nn.Linear(6, 3)  # rank 0's gradient is None: zeros from rank 0, as DDP

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        y = self.head(self.trunk(x))
        return y + self.rank1_only(x) if rank == 1 else y


class WithLateGroup(Branches):
    """Branches plus a layer the optimizer takes only mid-run, with ``add_param_group``."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        return super().forward(x, rank) + self.late(x)


class BatchNormNet(nn.Module):
    """A small CNN with BatchNorm: its running statistics are buffers that forward changes."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        return self.head(self.body(x).flatten(1))


@dataclass(frozen=True)
class Scenario:
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    ddp: bool  # compare with DDP; False: with an explicit all-reduce of the gradients that exist
    frozen_until: int = -1  # the trunk is frozen (requires_grad False) before this step
    eval_every: int = 0  # an evaluation forward under no_grad after every n-th step (buffers: no broadcast after it)
    add_group_at: int = -1  # the layer ``late`` joins the optimizer as a param group of its own before this step


SCENARIOS = {
    "unused": Scenario(Branches, (6,), ddp=True),
    "frozen_then_unfrozen": Scenario(Branches, (6,), ddp=False, frozen_until=4),
    "batchnorm": Scenario(BatchNormNet, (2, 6, 6), ddp=True, eval_every=3),
    "add_param_group": Scenario(WithLateGroup, (6,), ddp=False, add_group_at=3),
}


def param_groups(model: nn.Module) -> list[dict]:
    """Weights decay; biases and norms do not and train at another learning rate (``late`` is added later)."""
    named = [(n, p) for n, p in model.named_parameters() if not n.startswith("late.")]
    decay = [(n, p) for n, p in named if p.dim() >= 2]
    rest = [(n, p) for n, p in named if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-2}]


def data(step: int, rank: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(PER_RANK, *shape, generator=generator), torch.randn(PER_RANK, 3, generator=generator)


def average_existing_gradients(params: list[torch.Tensor]) -> None:
    """The semantics RemoteAdamW follows, spelled out: a gradient that is None on every rank stays
    None (the optimizer skips the parameter); one that exists on some rank is averaged over all ranks,
    with zeros from the ranks where it is None. For two ranks this equals DDP's divide-then-sum bitwise."""
    present = torch.tensor([float(p.grad is not None) for p in params])
    dist.all_reduce(present)
    for param, count in zip(params, present.tolist(), strict=True):
        if count:
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            dist.all_reduce(grad)
            param.grad = grad.div_(WORLD_SIZE)


def main(rank: int, store_port: int, runs: list[tuple[str, str, str, str, str]]) -> None:
    """Every run of ``runs`` (scenario, system, marker file, node address, output) in turn, in one gloo
    group the ranks form at the test's TCPStore on ``store_port``.

    One group for all runs: a group destroyed and formed again in the same process is a known hang in
    torch (now and then a rank's old group, still held by the DDP wrapper it had made, did not finish
    tearing down for a minute while the other rank waited to form the next one)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, WORLD_SIZE, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=60))
    try:
        for scenario_name, system, marker, node, out in runs:
            Path(marker).with_suffix(f".rank{rank}.running").touch()  # for the test's account of a run that hangs
            run(rank, scenario_name, system, node, out.format(rank=rank))
            dist.barrier()  # every collective of this run done on both ranks before the next begins
    finally:
        # Both ranks past their last collective before either tears the group down (a store barrier,
        # not a gloo one): a rank that returned from the last collective and closed its group first
        # left the other waiting for the rest of it until gloo's timeout.
        store.set(f"done/{rank}", b"1")
        store.wait([f"done/{peer}" for peer in range(WORLD_SIZE)], timedelta(seconds=60))
        dist.destroy_process_group()


def run(rank: int, scenario_name: str, system: str, node: str, out: str) -> None:
    """One rank of one scenario under ``system`` ("torch" or "netoptim"); writes ``out``."""
    from gpu_worker import RemoteAdamW

    scenario = SCENARIOS[scenario_name]
    torch.manual_seed(0)
    model = scenario.build()
    trunk = getattr(model, "trunk", None)
    if trunk is not None and scenario.frozen_until > 0:
        trunk.requires_grad_(False)
    groups = param_groups(model)
    if system == "torch":
        named = [{**g, "params": [p for _, p in g["params"]]} for g in groups]
        opt: torch.optim.Optimizer = torch.optim.AdamW(named, lr=1e-2, fused=True)
        forward = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True) if scenario.ddp else model
    else:
        opt = RemoteAdamW(groups, lr=1e-2, nodes=[node], rank=rank, world_size=WORLD_SIZE, module=model, timeout_s=60)
        forward = model
    # torch's schedulers cover the groups they were made with: none when a group joins mid-run
    lambdas = [lambda s: 1.0 / (1 + s), lambda s: 0.5 ** (s // 3)]
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambdas) if scenario.add_group_at < 0 else None
    for step in range(STEPS):
        if trunk is not None and step == scenario.frozen_until:
            trunk.requires_grad_(True)  # unfrozen: its moments start at zero, its step count at 0
        if step == scenario.add_group_at:
            late = list(model.late.named_parameters(prefix="late"))
            opt.add_param_group({"params": late if system == "netoptim" else [p for _, p in late], "lr": 5e-3, "weight_decay": 0.2})
        x, y = data(step, rank, scenario.input_shape)
        loss = (forward(x, rank) - y).pow(2).mean()
        loss.backward()
        if system == "torch" and not scenario.ddp:
            average_existing_gradients(list(model.parameters()))
        opt.step()
        model.zero_grad()  # every parameter's, also those no param group holds yet
        if scheduler is not None:
            scheduler.step()
        if scenario.eval_every and step % scenario.eval_every == scenario.eval_every - 1:
            model.eval()
            with torch.no_grad():
                forward(data(1000 + step, rank, scenario.input_shape)[0], rank)
            model.train()
    state = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    state.update({f"buffer.{n}": b.detach().clone() for n, b in model.named_buffers()})
    torch.save(state, Path(out))
    if system == "netoptim":
        opt.close()  # type: ignore[attr-defined]
