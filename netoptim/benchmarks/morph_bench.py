"""``netoptim bench morph``: a job that changes its data-parallel width while it trains.

Workers (threads, one per member, against a real node process) start at width 4; two are preempted
with notice (they leave at the boundary the members agree on), the job goes on at width 2, then a new
worker joins and it goes on at 3 (:mod:`gpu_worker.elastic`). The reference is torch's fused AdamW in
one process, fed at every step the average over that step's width of the ranks' gradients of their
shards (the same width schedule): with fp32 on the wire the two must be bitwise equal
(``max_abs_diff`` 0). ``max_abs_diff_vs_fixed_width`` compares with a job that kept width 4 all along:
not zero, because a different width sums the same samples in another order (rounding only, ~1e-7).
Each morph's pause (its slowest member's time at the boundary: agreement and new HELLO) is reported
against the median step time; ``"ratio"`` is the median step over the longest pause (above 0.5: every
pause is shorter than two steps).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from gpu_worker import RemoteAdamW
from gpu_worker.elastic import ElasticGroup, shard
from netoptim.launch.processes import NodeProcess

GLOBAL_BATCH = 12  # splits over 4, 3 and 2 workers
LR, WEIGHT_DECAY = 1e-2, 0.1


_SEEDING = threading.Lock()  # torch's default generator is one per process: members (threads) build their models in turn


def make_model(width: int = 32) -> nn.Module:
    with _SEEDING:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.LayerNorm(width), nn.Tanh(), nn.Linear(width, 4))


def samples(indices: range) -> tuple[torch.Tensor, torch.Tensor]:
    """The global samples ``indices``: each a function of its index alone."""
    xs, ys = [], []
    for index in indices:
        generator = torch.Generator().manual_seed(10_000 + index)
        xs.append(torch.randn(8, generator=generator))
        ys.append(torch.randn(4, generator=generator))
    return torch.stack(xs), torch.stack(ys)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


@dataclass
class ElasticRun:
    """What the elastic run did: each step's width, each member's time at each morph, step times."""

    widths: dict[int, int] = field(default_factory=dict)
    pauses: dict[int, list[float]] = field(default_factory=dict)  # morph step -> seconds per member
    step_times: list[float] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def run_elastic(address: str, steps: int, *, leave_after: int, join_after: int, model_width: int = 32) -> ElasticRun:
    """Train ``steps`` steps: 4 members; 2 asked to leave once step ``leave_after`` is done, one more
    joins once ``join_after`` is done."""
    store = torch.distributed.HashStore()
    ElasticGroup.create(store, ["w0", "w1", "w2", "w3"])
    run = ElasticRun()
    progress = threading.Condition()
    done_steps = [0]
    groups: dict[str, ElasticGroup] = {}

    def member(name: str, joining: bool) -> None:
        try:
            group = ElasticGroup(store, name, timeout_s=60)
            groups[name] = group
            first = group.join() if joining else group.start()
            model = make_model(model_width)
            options = {"join_at_step": first.at_step} if joining else {}
            opt = RemoteAdamW(
                model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, nodes=[address], rank=first.rank, world_size=first.world_size, timeout_s=60, **options
            )
            step = opt.remote_step
            while step < steps:
                entered = time.perf_counter()
                change = group.at_boundary(step)
                if change is not None:
                    if change.leaving:
                        break
                    opt.morph(change.rank, change.world_size, change.at_step)
                    with run.lock:
                        run.pauses.setdefault(step, []).append(time.perf_counter() - entered)
                started = time.perf_counter()
                x, y = samples(shard(step, GLOBAL_BATCH, opt.rank, opt.world_size))
                loss_of(model, x, y).backward()
                opt.step()
                opt.zero_grad()
                with run.lock:
                    run.widths.setdefault(step, opt.world_size)
                    if run.widths[step] != opt.world_size:
                        raise RuntimeError(f"step {step} trained at widths {run.widths[step]} and {opt.world_size}")
                    if opt.rank == 0:
                        run.step_times.append(time.perf_counter() - started)
                        run.params = [p.detach().clone() for p in model.parameters()]
                step += 1
                if opt.rank == 0:
                    with progress:
                        done_steps[0] = step
                        progress.notify_all()
            opt.close()
        except BaseException as exc:
            run.errors.append(exc)
            with progress:
                progress.notify_all()

    threads = {name: threading.Thread(target=member, args=(name, False), daemon=True) for name in ("w0", "w1", "w2", "w3")}
    for thread in threads.values():
        thread.start()

    def wait_for(step: int) -> None:
        with progress:
            progress.wait_for(lambda: done_steps[0] >= step or bool(run.errors), timeout=120)

    wait_for(leave_after)
    for name in ("w2", "w3"):  # preempted with notice: as their SIGTERM handler would
        groups[name].request_leave()
    wait_for(join_after)
    threads["w4"] = threading.Thread(target=member, args=("w4", True), daemon=True)
    threads["w4"].start()
    for thread in threads.values():
        thread.join(180)
    if any(thread.is_alive() for thread in threads.values()):
        run.errors.append(RuntimeError("a member hung"))
    return run


def reference(widths: dict[int, int], steps: int, model_width: int = 32) -> list[torch.Tensor]:
    """torch's fused AdamW fed, at each step, the average over that step's width of the ranks' shard gradients (in rank order)."""
    model = make_model(model_width)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    params = list(model.parameters())
    for step in range(steps):
        world = widths[step]
        totals: list[torch.Tensor] | None = None
        for rank in range(world):
            replica = make_model(model_width)
            replica.load_state_dict(model.state_dict())
            loss_of(replica, *samples(shard(step, GLOBAL_BATCH, rank, world))).backward()
            grads = [p.grad for p in replica.parameters()]
            totals = [g.clone() for g in grads] if totals is None else [t.add_(g) for t, g in zip(totals, grads, strict=True)]
        assert totals is not None
        for param, total in zip(params, totals, strict=True):
            param.grad = total / world
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in params]


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def measure(steps: int = 12, leave_after: int = 3, join_after: int = 7, model_width: int = 32, workdir: Path | None = None) -> dict:
    """Run the elastic job against a fresh node and compare; the JSON the command prints."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch, NodeProcess(Path(workdir or scratch)) as node:
        result = run_elastic(node.address, steps, leave_after=leave_after, join_after=join_after, model_width=model_width)
    if result.errors:
        raise RuntimeError(f"the elastic run failed: {result.errors[0]!r}") from result.errors[0]
    if sorted(result.widths) != list(range(steps)):
        raise RuntimeError(f"steps trained: {sorted(result.widths)}, expected 0..{steps - 1}: a step was lost or repeated")
    exact = reference(result.widths, steps, model_width)
    fixed = reference(dict.fromkeys(range(steps), 4), steps, model_width)
    step_s = statistics.median(result.step_times)
    pauses = {step: max(times) for step, times in sorted(result.pauses.items())}
    schedule = [[step, width] for step, width in sorted(result.widths.items()) if step == 0 or result.widths[step - 1] != width]
    return {
        "benchmark": "morph",
        "steps": steps,
        "widths": schedule,  # [step, width] where the width changed
        "max_abs_diff": max_abs_diff(result.params, exact),
        "max_abs_diff_vs_fixed_width": max_abs_diff(result.params, fixed),
        "median_step_s": step_s,
        "morph_pauses_s": {str(step): pause for step, pause in pauses.items()},
        "longest_pause_over_step": max(pauses.values()) / step_s if pauses else 0.0,
        "ratio": step_s / max(pauses.values()) if pauses else 0.0,  # a step over the longest pause: above 0.5, every pause is under two steps
    }


def run(args: argparse.Namespace) -> dict:
    """``netoptim bench morph``."""
    return measure(steps=args.steps, leave_after=args.leave_after, join_after=args.join_after, model_width=args.width)
