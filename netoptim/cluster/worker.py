"""The worker program of a cluster job: ``python -m netoptim.cluster.worker --mode netoptim|fsdp|ddp ...``.

It trains the recipes' byte-level GPT on the standard library's source (``netoptim.recipes``'s data,
each rank its share of every global batch) with one of three systems:

- ``netoptim``: ``RemoteAdamW`` full-model mode, pushing each bucket as soon as backward has it;
- ``fsdp``: ``torch.distributed.fsdp.fully_shard`` (full shard: every block, then the root) over gloo,
  with ``torch.optim.AdamW`` on the shards;
- ``ddp``: ``DistributedDataParallel`` over gloo with ``torch.optim.AdamW(fused=True)``.

The runner counts bytes only around the timed steps, so the ranks meet it at two file barriers in
``--sync-dir``: after the warm-up each writes ``ready-RANK`` and waits for ``go``; after the timed
steps it writes ``done-RANK.json`` and waits for ``release``, then saves and exits. A failure writes
``error-RANK`` with the reason.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)

MODES = ("netoptim", "fsdp", "ddp")
POLL_S = 0.002


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="One worker rank of an emulated-cluster job (started by netoptim cluster).")
    parser.add_argument("--mode", choices=MODES, required=True, help="the training system")
    parser.add_argument("--nodes", default="", help="netoptim: comma-separated node addresses, the same on every rank")
    parser.add_argument("--sync-dir", required=True, help="directory of the barrier files shared with the runner")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before the timed ones")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--n-layer", type=int, default=2, help="transformer blocks")
    parser.add_argument("--n-embd", type=int, default=128, help="model width")
    parser.add_argument("--n-head", type=int, default=4, help="attention heads")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (constant)")
    parser.add_argument("--seed", type=int, default=0, help="model init and data order")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this rank")
    parser.add_argument("--bucket-numel", type=int, default=0, help="netoptim: parameters per bucket (0: RemoteAdamW's default)")
    parser.add_argument("--pace-window-bytes", type=int, default=0, help="netoptim: RemoteAdamW's pace_window_bytes (0: none)")
    parser.add_argument("--host-groups", type=int, default=1, help="netoptim: 1 to sum a host's gradients in shared memory first (one flow per host)")
    parser.add_argument("--save-params", default="", help="rank 0: write its trained parameters here (torch.save of name -> tensor; with fsdp, its shards)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="give up waiting at a barrier after this long")
    return parser


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {timeout_s:.0f} s: the runner is gone or another rank is stuck")
        time.sleep(POLL_S)


def _touch(path: Path, text: str = "") -> None:
    """Write ``path`` atomically, so the runner never reads half of it."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def _build(args: argparse.Namespace, rank: int, world_size: int):
    """The model, what to call forward on, and the optimizer of ``args.mode``."""
    import torch

    from gpu_worker.models import GPT, GPTConfig
    from netoptim.recipes.train_gpt import decay_groups

    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head)
    torch.manual_seed(args.seed)  # every rank builds the same model
    model = GPT(config)
    hyper = dict(lr=args.lr, betas=(0.9, 0.95))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if args.mode == "netoptim" and args.host_groups and local_size > 1:
        from gpu_worker.hierarchical import HostGroupAdamW
        from gpu_worker.host_group import HostGroup

        host, local = divmod(rank, local_size)
        group = HostGroup(f"{os.environ.get('NETOPTIM_CLUSTER_RUN', 'cluster')}-{host}", local, local_size)
        optimizer = HostGroupAdamW(
            decay_groups(list(model.named_parameters())),
            host_group=group,
            nodes=args.nodes.split(","),
            rank=host,
            world_size=world_size // local_size,
            push_during_backward=True,  # each bucket summed and pushed as backward finishes it, as the flat job below
            same_host_ipc=False,
            timeout_s=args.timeout_s,
            **({"bucket_numel": args.bucket_numel} if args.bucket_numel else {}),
            **({"pace_window_bytes": args.pace_window_bytes} if args.pace_window_bytes else {}),
            **hyper,
        )
        return model, model, optimizer
    if args.mode == "netoptim":
        from gpu_worker import RemoteAdamW

        # Not on the same-host socket: the node's ipc:// path is reachable from every namespace of this
        # machine (a file), which would bypass the emulated links.
        optimizer = RemoteAdamW(
            decay_groups(list(model.named_parameters())),
            nodes=args.nodes.split(","),
            rank=rank,
            world_size=world_size,
            push_during_backward=True,
            same_host_ipc=False,
            timeout_s=args.timeout_s,
            **({"bucket_numel": args.bucket_numel} if args.bucket_numel else {}),
            **({"pace_window_bytes": args.pace_window_bytes} if args.pace_window_bytes else {}),
            **hyper,
        )
        return model, model, optimizer
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # MASTER_ADDR/PORT: rank 0's host, over the bridge
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
        return model, wrapped, torch.optim.AdamW(_torch_groups(model), fused=True, **hyper)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)  # all-gathered before its forward and its backward, resharded after each
    fully_shard(model)  # after which the parameters are the shards (DTensors): group them now
    return model, model, torch.optim.AdamW(_torch_groups(model), **hyper)


def _torch_groups(model: nn.Module) -> list[dict]:
    """The recipe's weight-decay groups, as torch optimizers take them (parameters without names)."""
    from netoptim.recipes.train_gpt import decay_groups

    return [{"params": [p for _, p in group["params"]], "weight_decay": group["weight_decay"]} for group in decay_groups(list(model.named_parameters()))]


def train(args: argparse.Namespace) -> dict:
    """Warm up, meet the runner, run the timed steps, meet it again; returns this rank's report."""
    import torch

    from netoptim.recipes.stdlib_text import batch_for_step, load_stdlib_bytes

    torch.set_num_threads(args.threads)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    sync = Path(args.sync_dir)
    model, forward, optimizer = _build(args, rank, world_size)
    tokens = load_stdlib_bytes()
    global_batch = args.micro_batch * world_size
    step_times, loss = [], float("nan")
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            _touch(sync / f"ready-{rank}")
            _wait_for(sync / "go", args.timeout_s)
        started = time.perf_counter()
        x, y = batch_for_step(tokens, step, global_batch=global_batch, block_size=args.block_size, rank=rank, world_size=world_size, seed=args.seed)
        _, loss_tensor = forward(x, y)
        loss_tensor.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_tensor.item()
        step_times.append(time.perf_counter() - started)
    report = {"rank": rank, "step_s": step_times[args.warmup :], "loss": loss}
    _touch(sync / f"done-{rank}.json", json.dumps(report))
    _wait_for(sync / "release", args.timeout_s)
    if args.save_params and rank == 0:
        torch.save({name: p.detach().clone() for name, p in model.named_parameters()}, args.save_params)
    if args.mode == "netoptim":
        optimizer.close()
    else:
        import torch.distributed as dist

        dist.destroy_process_group()
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("NETOPTIM_LOG_LEVEL", "WARNING"), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.mode == "netoptim" and not args.nodes:
        print("--mode netoptim needs --nodes", file=sys.stderr)
        return 2
    try:
        train(args)
    except BaseException as exc:
        rank = os.environ.get("RANK", "0")
        _touch(Path(args.sync_dir) / f"error-{rank}", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
