"""A training worker for the fault-injection tests, run as its own process.

It trains a tiny GPT from the step the nodes give it (``remote_step``) to ``--steps``, with data that
is a function of the step and the rank only, the way a training script must resume. With
``--die-at PHASE:STEP:N`` it kills itself (SIGKILL: no cleanup, no flush) at the N-th event of PHASE
during step STEP: ``forward`` (before the N-th block's forward), ``backward`` (at the N-th gradient),
``push`` (before the N-th bucket push) or ``pull`` (after installing N buckets of new values). With
``--signal-at PHASE:STEP:N --signal STOP --to PID`` it sends another signal, or to other processes
(``self`` names this one; it is signalled last): a node killed or stopped at a worker's phase. Rank 0
writes the final parameters to ``--out``.

    python -m tests.faults.worker_program --nodes tcp://127.0.0.1:5555 --rank 0 --world 2 --steps 4 --out final.pt
"""

from __future__ import annotations

import argparse
import os
import signal

import torch

from gpu_worker import RemoteAdamW, offload
from gpu_worker.exchange.awaited_values import AwaitedValues
from gpu_worker.exchange.gradient_pushes import GradientPushes
from gpu_worker.layerwise.streaming import LayerStreamer
from gpu_worker.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
BUCKET_NUMEL = 2048


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s share of step ``step``'s global batch: the same whoever computes it, whenever."""
    generator = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.block_size + 1), generator=generator)
    per = data.shape[0] // world_size
    part = data[rank * per : (rank + 1) * per]
    return part[:, :-1].contiguous(), part[:, 1:].contiguous()


class DeathPlan:
    """Counts events of one phase during one step and, at the N-th, sends ``signum`` to ``targets``
    (default: SIGKILL to this process), once."""

    def __init__(self, spec: str | None, signum: int = signal.SIGKILL, targets: tuple[int, ...] = ()) -> None:
        self.phase, self.step, self.nth = None, -1, 0
        if spec:
            phase, step, nth = spec.split(":")
            self.phase, self.step, self.nth = phase, int(step), int(nth)
        self.signum = signum
        self.targets = targets or (os.getpid(),)
        self.current_step = -1
        self.count = 0
        self.done = False

    def event(self, phase: str) -> None:
        if self.done or phase != self.phase or self.current_step != self.step:
            return
        self.count += 1
        if self.count >= self.nth:
            self.done = True
            print(f"signal plan: sending {signal.Signals(self.signum).name} to {self.targets} at {phase}:{self.step}:{self.count}", flush=True)
            for pid in sorted(self.targets, key=lambda pid: pid == os.getpid()):  # this process last
                os.kill(pid, self.signum)


def install(plan: DeathPlan, model: GPT) -> None:
    """Hooks and wrappers that report the events a death plan counts."""
    for block in model.blocks:
        block.register_forward_pre_hook(lambda _m, _a: plan.event("forward"))
    for param in model.parameters():
        if param.requires_grad:
            param.register_hook(lambda grad: (plan.event("backward"), grad)[1])
    push = GradientPushes.push_bucket

    def push_bucket(pushes, *args, **kwargs):
        plan.event("push")
        return push(pushes, *args, **kwargs)

    GradientPushes.push_bucket = push_bucket
    push_run = GradientPushes.push_run

    def push_batch(pushes, run, *args, **kwargs):
        if len(run) > 1:  # one push event per bucket of a batch (a run of one goes through push_bucket)
            for _bucket in run:
                plan.event("push")
        return push_run(pushes, run, *args, **kwargs)

    GradientPushes.push_run = push_batch
    install_full = AwaitedValues.install

    def installed(values, *args, **kwargs):
        install_full(values, *args, **kwargs)
        plan.event("pull")

    AwaitedValues.install = installed
    on_params = LayerStreamer._on_params

    def arrived(streamer, *args, **kwargs):
        on_params(streamer, *args, **kwargs)
        plan.event("pull")

    LayerStreamer._on_params = arrived


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", required=True, help="comma-separated node addresses")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument(
        "--mode",
        choices=["full", "full-8bit", "early", "paced", "overlapped", "layerwise", "layerwise-kept"],
        default="full",
        help="early: push during backward; paced: also with a two-bucket push window; overlapped: also overlap_forward (pulls happen in forward); "
        "layerwise-kept: layer-wise with every block kept from forward to backward (backward fetches none); "
        "full-8bit: the nodes keep the moments in 8 bits (buckets large enough that the MLP weights are compressed)",
    )
    parser.add_argument("--die-at", default=None, help="PHASE:STEP:N, see the module docstring")
    parser.add_argument("--out", default=None, help="rank 0: where to save the final parameters")
    parser.add_argument("--signal-at", default=None, help="PHASE:STEP:N at which to send --signal to --to")
    parser.add_argument("--signal", default="KILL", help="signal name without SIG (KILL, STOP)")
    parser.add_argument("--to", default="self", help="comma-separated pids; self: this process")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--heartbeat", type=float, default=2.0)
    parser.add_argument("--silent-after", type=float, default=10.0)
    parser.add_argument("--reconnect", type=float, default=20.0)
    parser.add_argument("--no-same-host", action="store_true", help="stay on the address given (through a proxy) instead of the node's ipc socket")
    args = parser.parse_args()
    if args.die_at and args.signal_at:
        parser.error("--die-at and --signal-at exclude each other")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if args.signal_at:
        targets = tuple(os.getpid() if pid == "self" else int(pid) for pid in args.to.split(","))
        plan = DeathPlan(args.signal_at, signal.Signals[f"SIG{args.signal}"], targets)
    else:
        plan = DeathPlan(args.die_at)
    install(plan, model)
    options = dict(
        nodes=args.nodes.split(","), rank=args.rank, world_size=args.world, lr=3e-3, weight_decay=0.1, bucket_numel=BUCKET_NUMEL, timeout_s=args.timeout
    )
    options |= dict(heartbeat_s=args.heartbeat, silent_after_s=args.silent_after, reconnect_s=args.reconnect, same_host_ipc=not args.no_same_host)
    if args.mode.startswith("layerwise"):
        opt = offload(model, model.blocks, prefetch=1, keep_for_backward=(1 << 30) if args.mode == "layerwise-kept" else 0, **options)
    else:
        if args.mode == "paced":
            options["pace_window_bytes"] = 2 * BUCKET_NUMEL * 4
        if args.mode == "overlapped":
            options |= {"overlap_forward": True, "module": model}
        if args.mode == "full-8bit":
            options |= {"moments": "8bit", "bucket_numel": 4 * BUCKET_NUMEL}
        opt = RemoteAdamW(model.named_parameters(), push_during_backward=args.mode in ("early", "paced", "overlapped"), **options)
    for step in range(opt.remote_step, args.steps):
        plan.current_step, plan.count = step, 0
        _logits, loss = model(*batch(step, args.rank, args.world))
        loss.backward()
        opt.step()
        opt.zero_grad()
    plan.current_step = -1
    final = opt.gather_parameters()
    if args.out and args.rank == 0:
        torch.save(final, args.out)
    opt.close()


if __name__ == "__main__":
    main()
