"""What the integration tests share: the tiny model the rank programs train, its data and settings,
the torchrun launch, and the single-process oracle their results are compared with. It imports no
framework: the test modules are collected by every pytest worker, and only the worker that runs them
pays for importing transformers or Lightning."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from netoptim.launch.processes import NodeProcess
from tests.gpu_worker.harness import average_in_rank_order, make_model

WORLD_SIZE = 2
ROOT = Path(__file__).parents[2]

STEPS, SAVED_AT, PER_RANK = 6, 3, 4
"""Steps of every run, the step a run is checkpointed at and stopped after, samples per rank and step."""
LR, WEIGHT_DECAY, WARMUP, CLIP = 1e-2, 0.1, 2, 0.05
"""The runs' hyperparameters: peak learning rate, weight decay (biases and norms: none), warmup steps, max_grad_norm."""
LOOSE = 1e6
"""A clipping threshold no gradient here reaches: the nodes' clip factor is 1, so a run with it stays bitwise."""


class Regression(nn.Module):
    """The worker tests' model (:func:`tests.gpu_worker.harness.make_model`) with a loss: ``forward``
    returns ``{"loss": mse}``, as a Hugging Face model does, and keeps the inputs it trained on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            self.seen.append((x.detach().clone(), labels.detach().clone()))
        return {"loss": loss_of(self.net, x, labels)}


def warmup_then_linear(step: int) -> float:
    """The learning-rate factor of step ``step``: linear from 0 over ``WARMUP`` steps, then linear to 0
    at ``STEPS`` (Hugging Face's ``linear`` schedule, which the Lightning runs use too)."""
    if step < WARMUP:
        return step / WARMUP
    return max(0.0, (STEPS - step) / (STEPS - WARMUP))


def decay_groups(model: nn.Module) -> list[dict]:
    """Weight decay on the Linear weights; none on biases and the LayerNorm (Trainer's grouping)."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if n.endswith("weight") and p.dim() >= 2]
    rest = [p for n, p in named if not (n.endswith("weight") and p.dim() >= 2)]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]


def loss_of(net: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (net(x) - labels).pow(2).mean()


def samples(count: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression data from a fixed seed."""
    generator = torch.Generator().manual_seed(7)
    return torch.randn(count, 8, generator=generator), torch.randn(count, 4, generator=generator)


def start_nodes(workdir: Path, names: Sequence[str]) -> dict[str, NodeProcess]:
    """One ``netoptim node`` per name, started side by side (each takes a second or two to be ready)."""
    nodes = {name: NodeProcess(workdir, name=name) for name in names}
    with ThreadPoolExecutor(len(nodes)) as pool:
        list(pool.map(NodeProcess.start, nodes.values()))
    return nodes


def torchrun(module: str, args: Sequence[str], workdir: Path, timeout_s: float = 120) -> None:
    """``torchrun --standalone --nproc-per-node 2 -m module args`` from the repository root, one
    thread per rank and no network but loopback; fails the test with the ranks' output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD_SIZE), "-m", module, *args]
    started = time.monotonic()
    with open(workdir / "ranks.log", "wb") as out:
        result = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
    if result.returncode != 0:
        raise AssertionError(
            f"{module} exited with {result.returncode} after {time.monotonic() - started:.1f} s:\n{(workdir / 'ranks.log').read_text()[-6000:]}"
        )


def ranks_of_a_run(root: Path, program: str) -> list[dict]:
    """Run ``program`` (a module of ``tests.integrations``) under :func:`torchrun` against one fresh
    node, and return what each rank saved (``rankN.pt`` in ``root``), with ``root`` beside it."""
    node = start_nodes(root, ["node"])["node"]
    try:
        torchrun(f"tests.integrations.{program}", ["--address", node.address, "--out", str(root)], root)
    finally:
        assert node.stop() == 0, node.log_text()[-3000:]
    return [{**torch.load(root / f"rank{rank}.pt", weights_only=False), "root": root} for rank in range(WORLD_SIZE)]


def averaged_reference(
    model: nn.Module,
    batches: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
    make_optimizer: Callable[[nn.Module], tuple[torch.optim.Optimizer, object]],
    *,
    max_grad_norm: float | None = None,
) -> tuple[dict[str, torch.Tensor], list[list[dict[str, torch.Tensor]]], list[float]]:
    """The oracle: one process computes each rank's gradient on the batch that rank trained on
    (``batches[step][rank]``), averages them as the nodes do (:func:`average_in_rank_order`), clips
    with ``clip_grad_norm_`` when asked, and steps torch's optimizer and scheduler
    (``make_optimizer(model)``). Returns the final parameters, each step's per-rank gradients and
    the norms before clipping."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: a matrix product may sum in another order with more threads
    try:
        optimizer, scheduler = make_optimizer(model)
        params = dict(model.named_parameters())
        local: list[list[dict[str, torch.Tensor]]] = []
        norms: list[float] = []
        for per_rank in batches:
            grads = []
            for x, y in per_rank:
                replica = copy.deepcopy(model)
                loss_of(replica.net, x, y).backward()
                grads.append({name: p.grad for name, p in replica.named_parameters()})
            local.append(grads)
            averaged = average_in_rank_order([[g[name] for name in params] for g in grads])
            for param, grad in zip(params.values(), averaged, strict=True):
                param.grad = grad
            if max_grad_norm is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(list(params.values()), max_grad_norm)))
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()  # type: ignore[attr-defined]
        return {name: p.detach().clone() for name, p in params.items()}, local, norms
    finally:
        torch.set_num_threads(threads)


def assert_bitwise(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], what: str) -> None:
    assert expected.keys() == actual.keys(), what
    differing = [name for name in expected if not torch.equal(expected[name], actual[name])]
    if differing:
        worst = max(float((expected[n] - actual[n]).abs().max()) for n in differing)
        raise AssertionError(f"{what}: {differing} differ (max {worst:.3g})")


def max_difference(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> float:
    return max(float((expected[n] - actual[n]).abs().max()) for n in expected)
