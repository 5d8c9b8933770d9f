"""Training harness shared by the worker tests: a small model, fixed data, workers as threads and the
single-process references the offloaded run is compared with."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from gpu_worker import RemoteAdamW, RemoteOptimizer, offload

STEPS = 20
GLOBAL_BATCH = 8


def make_model(seed: int = 0) -> nn.Module:
    """Every parameter gets a real gradient (no key biases, nothing whose true gradient is zero)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=generator), torch.randn(GLOBAL_BATCH, 4, generator=generator)


def shard(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(step)
    per = GLOBAL_BATCH // world_size
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def param_groups(model: nn.Module, *, named: bool = False) -> list[dict]:
    """Two groups: weights with weight decay, biases and norms with another lr and none."""
    decay = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [(n, p) for n, p in model.named_parameters() if p.dim() < 2]
    pick = (lambda pairs: pairs) if named else (lambda pairs: [p for _, p in pairs])
    return [{"params": pick(decay), "weight_decay": 0.1}, {"params": pick(rest), "weight_decay": 0.0, "lr": 2e-2}]


def schedule(step: int) -> float:
    return 1.0 if step < 10 else 0.5


@dataclass
class RunConfig:
    world_size: int = 2
    nodes: Sequence[str] = ()
    wire_dtype: torch.dtype = torch.float32
    max_grad_norm: float | None = None
    bucket_numel: int = 300  # small, so parameters split over buckets and buckets over nodes
    steps: int = STEPS
    extra: dict = field(default_factory=dict)  # optimizer options; they may override lr and weight_decay
    layerwise: bool = False  # stream the three Linear layers as units; the LayerNorm stays in the root unit
    overlap_forward: bool = False  # full mode: step() returns with the gradients out; the next forward waits per module
    optimizer: Callable[..., RemoteOptimizer] = RemoteAdamW
    inspect: Callable[[int, RemoteOptimizer], None] | None = None  # called with each rank's optimizer after training


def run_offloaded(config: RunConfig) -> tuple[list[torch.Tensor], list[float | None]]:
    """Train ``world_size`` worker threads against the nodes; returns rank 0's final parameters
    (after checking every rank ends identical) and rank 0's gradient norms."""
    models = [make_model() for _ in range(config.world_size)]
    results: dict[int, list[torch.Tensor]] = {}
    norms: list[float | None] = []
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            model = models[rank]
            options = {
                "lr": 1e-2,
                "weight_decay": 0.1,
                "nodes": list(config.nodes),
                "rank": rank,
                "world_size": config.world_size,
                "wire_dtype": config.wire_dtype,
                "max_grad_norm": config.max_grad_norm,
                "bucket_numel": config.bucket_numel,
                "timeout_s": 60,
                **config.extra,
            }
            if config.layerwise:
                opt = offload(model, [model[0], model[2], model[5]], params=param_groups(model, named=True), **options)
            else:
                if config.overlap_forward:
                    options.update(overlap_forward=True, module=model)
                opt = config.optimizer(param_groups(model, named=True), **options)
            # Layer-wise and overlapped steps: the last step's norm comes with this forward's parameters
            # (read before, it would wait for the step: correct, but no forward would overlap it).
            norm_after_forward = config.layerwise or config.overlap_forward
            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
            for step in range(config.steps):
                loss = loss_fn(model, *shard(step, rank, config.world_size))
                if rank == 0 and norm_after_forward and step > 0:
                    norms.append(opt.last_grad_norm)
                loss.backward()
                opt.step()
                opt.zero_grad()
                scheduler.step()
                if rank == 0 and not norm_after_forward:
                    norms.append(opt.last_grad_norm)
            values = opt.gather_parameters()
            if rank == 0 and norm_after_forward:
                norms.append(opt.last_grad_norm)
            results[rank] = [values[name] for name, _ in model.named_parameters()]
            if config.inspect is not None:
                config.inspect(rank, opt)
            opt.close()
        except BaseException as exc:
            errors.append(exc)

    run_threads(worker, config.world_size)
    if errors:
        raise errors[0]
    for rank in range(1, config.world_size):
        for a, b in zip(results[0], results[rank], strict=True):
            assert torch.equal(a, b), f"rank {rank} ended with different parameters than rank 0"
    return results[0], norms


def run_threads(target: Callable[[int], None], count: int, timeout_s: float = 120) -> None:
    threads = [threading.Thread(target=target, args=(rank,), daemon=True) for rank in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
        assert not thread.is_alive(), "a worker thread hung"


def average_in_rank_order(shard_grads: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """What the nodes compute from ``shard_grads[rank][i]``: each parameter's gradients summed in rank
    order (rank 0's first), then divided by the number of ranks."""
    averaged = []
    for index in range(len(shard_grads[0])):
        total = shard_grads[0][index].clone()
        for grads in shard_grads[1:]:
            total += grads[index]
        averaged.append(total / len(shard_grads))
    return averaged


def reference_averaged(
    world_size: int,
    *,
    fused: bool,
    max_grad_norm: float | None = None,
    steps: int = STEPS,
    make_optimizer: Callable[[list[dict]], torch.optim.Optimizer] | None = None,
) -> tuple[list[torch.Tensor], list[float]]:
    """Reference A: one process computes each worker's shard gradient, averages them in rank order
    (sum, then divide) and runs ``torch.optim.AdamW`` (or ``make_optimizer(param_groups)``)."""
    model = make_model()
    groups = param_groups(model)
    opt = make_optimizer(groups) if make_optimizer is not None else torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    params = list(model.parameters())
    norms = []
    for step in range(steps):
        shard_grads = []
        for rank in range(world_size):
            replica = copy.deepcopy(model)
            loss_fn(replica, *shard(step, rank, world_size)).backward()
            shard_grads.append([p.grad for p in replica.parameters()])
        for param, grad in zip(params, average_in_rank_order(shard_grads), strict=True):
            param.grad = grad
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)))
        opt.step()
        opt.zero_grad()
        scheduler.step()
    return [p.detach().clone() for p in params], norms


def reference_whole_batch(steps: int = STEPS, max_grad_norm: float | None = None) -> list[torch.Tensor]:
    """Reference B: one process on the whole batch."""
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for step in range(steps):
        loss_fn(model, *batch(step)).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
        scheduler.step()
    return [p.detach().clone() for p in model.parameters()]


def max_difference(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
