"""Data-parallel training of a small GPT with the optimizer on netoptim nodes.

One worker per process; ``RANK`` and ``WORLD_SIZE`` come from ``torchrun`` (or ``netoptim demo``).
There is no all-reduce among the workers: each pushes its gradients to the optimizer nodes, which
average them, apply AdamW and send the new parameters back. See ``examples/train_gpt.py`` for the
launch commands.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn
from tqdm import tqdm

from gpu_worker import RemoteAdamW, offload
from gpu_worker.discovery import nodes_option
from gpu_worker.models import GPT, GPTConfig, gpt_initializer
from netoptim.recipes.stdlib_text import batch_for_step, load_stdlib_bytes
from protos.job.moment_formats import MOMENT_FORMATS

log = logging.getLogger(__name__)

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Train a small byte-level GPT on the Python standard library with netoptim.")
    add_training_flags(parser)
    add_model_flags(parser, block_size=128)
    parser.add_argument("--sample-tokens", type=int, default=160, help="bytes to generate at the end (rank 0)")
    parser.add_argument("--layerwise", action="store_true", help="stream the blocks from the nodes (layer-wise mode): the model is never whole on a worker")
    parser.add_argument("--prefetch", type=int, default=1, help="layer-wise: blocks fetched ahead of the one computing")
    parser.add_argument(
        "--keep-for-backward",
        type=int,
        default=0,
        metavar="BYTES",
        help="layer-wise: bytes of parameters of the last blocks that stay from forward to backward, which then does not fetch them again "
        "(default: 0, the last --prefetch + 1 blocks only)",
    )
    parser.add_argument("--push-during-backward", action="store_true", help="full model: push each bucket of gradients as backward finishes it, not at step()")
    parser.add_argument(
        "--overlap-forward",
        action="store_true",
        help="full model: step() returns with the gradients out, and each block's next forward waits for its own new values (the nodes finish "
        "the last blocks' updates while the first ones compute)",
    )
    parser.add_argument(
        "--no-keep-step-gradients",
        dest="keep_step_gradients",
        action="store_false",
        help="full model: let each step's gradients go once pushed (RemoteAdamW(keep_step_gradients=False)): with --overlap-forward a "
        "gradient's size of GPU memory less through the next forward; a node restarted mid-step then stops the workers, saying to restart them",
    )
    parser.add_argument(
        "--pace-window-kib",
        type=int,
        default=0,
        help="full model, with --push-during-backward: KiB of pushed gradients whose new values have not come back that a worker may have in "
        "flight (paced pushes: docs/launch.md); 0: no window",
    )
    add_security_flags(parser)
    return parser


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    """The nodes, the steps and the batch, torch's threads, the buckets, the moments' format and the loss
    file: the flags of every recipe that trains one job through :func:`train`."""
    parser.add_argument(
        "--nodes",
        default=None,
        help="optimizer nodes: addresses separated by commas (the same on every rank), or a host file (one address per line); "
        "default: $NETOPTIM_NODES or $NETOPTIM_NODE_FILE. A host file or the variables are read on rank 0, which shares the list under torchrun",
    )
    parser.add_argument("--steps", type=int, default=300, help="total training steps (a resumed run continues to this step)")
    parser.add_argument("--global-batch", type=int, default=0, help="sequences per step over all workers (default: 8 per worker)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: torch's default)")
    parser.add_argument(
        "--bucket-numel",
        type=int,
        default=0,
        help="parameters per bucket (default: 0, RemoteAdamW's: 4 Mi, halved down to 1 Mi while a node would get fewer than 16 buckets)",
    )
    parser.add_argument(
        "--moments",
        choices=MOMENT_FORMATS,
        default="fp32",
        help="how the nodes store AdamW's moments: fp32 (torch's AdamW bitwise), bf16 (half the bytes), or 8bit (blockwise 8-bit with a scale "
        "per 256 elements, as torchao's and bitsandbytes' 8-bit AdamW; about a quarter of the bytes); tensors under 4,096 elements stay fp32 "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--loss-file",
        default=None,
        metavar="FILE",
        help="at the end, write the loss of every step trained (this rank's share of the batch) to FILE as JSON "
        '({"rank", "start_step", "losses"}); {rank} is replaced by the rank, and without it only rank 0 writes',
    )


def add_model_flags(parser: argparse.ArgumentParser, *, block_size: int) -> None:
    """The GPT's shape, learning rate, wire dtype and seed: the flags every GPT recipe takes."""
    parser.add_argument("--block-size", type=int, default=block_size, help="tokens per sequence")
    parser.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    parser.add_argument("--n-embd", type=int, default=128, help="model width")
    parser.add_argument("--n-head", type=int, default=4, help="attention heads")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warmup, then cosine decay)")
    parser.add_argument("--wire-dtype", choices=sorted(WIRE_DTYPES), default="float32", help="dtype on the wire")
    parser.add_argument("--seed", type=int, default=0, help="model init and data order")


def parse_recipe_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse a recipe's flags, taking what they leave unset from the ``[worker]`` table of ``--config``."""
    from netoptim.job.config_file import ConfigFileError, apply_config_file

    parser.add_argument(
        "--config", default=None, metavar="FILE", help="read flags from the [worker] table of this TOML file (keys: the flags' long names); flags override it"
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        apply_config_file(parser, argv, "worker")
    except ConfigFileError as exc:
        parser.error(str(exc))
    return parser.parse_args(argv)


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """CURVE keys for nodes that require them (``netoptim node --curve-secret-key``)."""
    parser.add_argument(
        "--curve-secret-key",
        default=None,
        metavar="FILE",
        help="this worker's .key_secret file (netoptim keygen); {rank} is replaced by the rank, e.g. keys/worker{rank}.key_secret",
    )
    parser.add_argument("--curve-server-key", default=None, metavar="FILE", help="the nodes' public .key file (with --curve-secret-key)")


def security_options(args: argparse.Namespace, rank: int) -> dict:
    """RemoteAdamW's CURVE options from the flags of :func:`add_security_flags`."""
    if bool(args.curve_secret_key) != bool(args.curve_server_key):
        raise SystemExit("--curve-secret-key and --curve-server-key go together")
    if not args.curve_secret_key:
        return {}
    return {"curve_secret_key": args.curve_secret_key.replace("{rank}", str(rank)), "curve_server_key": args.curve_server_key}


def model_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head)


def decay_groups(named: list[tuple[str, nn.Parameter]]) -> list[dict]:
    """Weight decay on matrices only; named, so checkpoints export with the model's own names. A group
    with no parameter is left out (a pipeline stage of embeddings alone has no vector)."""
    groups = [
        {"params": [(n, p) for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def param_groups(model: nn.Module) -> list[dict]:
    return decay_groups(list(model.named_parameters()))


def lr_lambda(steps: int) -> Callable[[int], float]:
    warmup = max(1, steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def write_losses(path: str, rank: int, start_step: int, losses: Sequence[float]) -> None:
    """``--loss-file``: the losses of steps ``start_step``, ``start_step + 1``, ... as JSON, written whole
    under a temporary name and renamed, so a reader never sees half a file."""
    partial = f"{path}.partial"
    with open(partial, "w") as handle:
        json.dump({"rank": rank, "start_step": start_step, "losses": list(losses)}, handle)
    os.replace(partial, path)


def start_worker(args: argparse.Namespace) -> tuple[int, int, int]:
    """Set up logging and torch's threads; this worker's rank, the world size (from ``torchrun``'s
    environment) and the global batch. ``SystemExit`` for flags of :func:`add_training_flags` that
    cannot run."""
    logging.basicConfig(level=os.environ.get("NETOPTIM_LOG_LEVEL", "WARNING"), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    global_batch = args.global_batch or 8 * world_size
    if global_batch % world_size:
        raise SystemExit(f"--global-batch {global_batch} is not divisible by the {world_size} workers")
    if args.bucket_numel < 0:
        raise SystemExit(f"--bucket-numel must be positive (or 0: the default), got {args.bucket_numel}")
    return rank, world_size, global_batch


def optimizer_options(args: argparse.Namespace, rank: int, world_size: int) -> dict:
    """The options of the job's optimizer (``RemoteAdamW`` or ``offload``) that the flags of
    :func:`add_training_flags`, :func:`add_model_flags` and :func:`add_security_flags` set."""
    options = dict(
        lr=args.lr,
        betas=(0.9, 0.95),
        nodes=nodes_option(args.nodes),
        rank=rank,
        world_size=world_size,
        wire_dtype=WIRE_DTYPES[args.wire_dtype],
        moments=args.moments,
    )
    options.update(security_options(args, rank))
    if args.bucket_numel:
        options["bucket_numel"] = args.bucket_numel
    return options


def train(
    step_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: RemoteAdamW,
    args: argparse.Namespace,
    *,
    rank: int,
    world_size: int,
    global_batch: int,
) -> list[float]:
    """Train from the step the nodes are at (``optimizer.remote_step``) to ``--steps`` on the standard
    library's bytes: ``step_loss(x, y)`` is the loss of this rank's share of a batch (input bytes ``x``,
    next bytes ``y``). Warmup, then cosine decay of the learning rate; writes ``--loss-file`` and, on
    rank 0, a summary. Returns the loss of every step trained."""
    start_step = optimizer.remote_step  # non-zero when the nodes already trained this job
    schedule = lr_lambda(args.steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule(step + start_step))
    tokens = load_stdlib_bytes()
    tokens_per_step = global_batch * args.block_size
    losses: list[float] = []
    progress = tqdm(
        range(start_step, args.steps),
        **({"disable": True} if rank != 0 else {}),
        desc="training",
        unit="step",
        initial=start_step,
        total=args.steps,
        mininterval=0.5,
    )
    started = time.perf_counter()
    for step in progress:
        x, y = batch_for_step(tokens, step, global_batch=global_batch, block_size=args.block_size, rank=rank, world_size=world_size, seed=args.seed)
        loss = step_loss(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
        elapsed = time.perf_counter() - started
        progress.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_step * len(losses) / elapsed:,.0f}")
    progress.close()
    if args.loss_file and (rank == 0 or "{rank}" in args.loss_file):
        write_losses(args.loss_file.replace("{rank}", str(rank)), rank, start_step, losses)
    if rank == 0 and losses:
        window = max(1, min(10, len(losses) // 4))
        first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
        elapsed = time.perf_counter() - started
        print(
            f"loss: {first:.3f} at the start -> {last:.3f} at the end (means of {window} steps); {len(losses)} steps in {elapsed:.1f} s, {tokens_per_step * len(losses) / elapsed:,.0f} tokens/s over {world_size} workers"
        )
    return losses


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_recipe_args(build_parser(), argv)
    rank, world_size, global_batch = start_worker(args)
    if args.layerwise and (args.push_during_backward or args.pace_window_kib or args.overlap_forward or not args.keep_step_gradients):
        raise SystemExit(
            "--push-during-backward, --pace-window-kib, --overlap-forward and --no-keep-step-gradients are for the full model: layer-wise "
            "workers always push as backward goes, keep no gradients and fetch each block for its forward"
        )
    if args.pace_window_kib < 0 or (args.pace_window_kib and not args.push_during_backward):
        raise SystemExit("--pace-window-kib needs --push-during-backward and a positive size")
    torch.manual_seed(args.seed)  # every rank builds the same model; rank 0's values are registered
    config = model_config(args)
    options = optimizer_options(args, rank, world_size)
    if args.keep_for_backward < 0:
        raise SystemExit(f"--keep-for-backward must be a byte count >= 0, got {args.keep_for_backward}")
    if args.layerwise:
        with torch.device("meta"):  # rank 0 initializes one block at a time, straight to the nodes
            model = GPT(config)
        optimizer = offload(
            model,
            model.blocks,
            params=param_groups,
            init_fn=gpt_initializer(config),
            prefetch=args.prefetch,
            keep_for_backward=args.keep_for_backward,
            **options,
        )
    else:
        model = GPT(config)
        if args.pace_window_kib:
            options["pace_window_bytes"] = args.pace_window_kib * 1024
        if args.overlap_forward:
            options |= {"overlap_forward": True, "module": model}
        optimizer = RemoteAdamW(param_groups(model), push_during_backward=args.push_during_backward, keep_step_gradients=args.keep_step_gradients, **options)
    losses = train(lambda x, y: model(x, y)[1], optimizer, args, rank=rank, world_size=world_size, global_batch=global_batch)
    if rank == 0 and losses:
        optimizer.synchronize()  # --overlap-forward: the last step's values are in before the sample reads them
        model.eval()
        prompt = torch.tensor([list(b"def ")], dtype=torch.long)
        sample = model.generate(prompt, args.sample_tokens, generator=torch.Generator().manual_seed(args.seed))
        print("sample:\n" + bytes(sample[0].tolist()).decode("utf-8", errors="replace"))
    optimizer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
