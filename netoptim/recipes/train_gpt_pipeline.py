"""Pipeline-parallel training of a small GPT (P stages x D replicas) with the optimizer on netoptim nodes.

Launch ``P x D`` ranks with ``torchrun`` (see ``examples/train_gpt_pipeline.py``); rank ``r`` computes
pipeline position ``r % P`` of replica ``r // P``. Each pipeline position trains as its own netoptim
job on its own group of optimizer nodes (``--nodes`` is dealt out in ``P`` equal groups).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from gpu_worker.discovery import discover_nodes, nodes_option
from gpu_worker.models import GPT
from gpu_worker.pipeline import SCHEDULES, PipelineConfig, PipelineError, PipelineTrainer
from netoptim.recipes.stdlib_text import batch_for_step, load_stdlib_bytes
from netoptim.recipes.train_gpt import (
    WIRE_DTYPES,
    add_model_flags,
    add_security_flags,
    decay_groups,
    lr_lambda,
    model_config,
    parse_recipe_args,
    security_options,
)

__all__ = ["decay_groups", "main", "token_loss"]

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--nodes",
        default=None,
        help="optimizer nodes, a multiple of --stages: addresses separated by commas (the same on every rank), or a host file read on rank 0 "
        "(one address per line); default: $NETOPTIM_NODES or $NETOPTIM_NODE_FILE on rank 0",
    )
    parser.add_argument("--stages", type=int, default=2, help="pipeline positions P (ranks per replica); the world size must be a multiple")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per replica and step")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule")
    parser.add_argument("--stages-per-rank", type=int, default=0, help="interleaved schedule: stages per rank (default 2 there, else 1)")
    parser.add_argument("--cuts", default="auto", help="first block of every stage but the first, comma-separated; 'auto' balances on a calibration")
    parser.add_argument(
        "--repartition-at",
        type=int,
        default=-1,
        help="morph the pipeline before this step: another split (--repartition-cuts) and number of stages (--repartition-stages), the same "
        "training state; -1: never",
    )
    parser.add_argument("--repartition-stages", type=int, default=0, help="pipeline positions after the morph (default: --stages); replicas follow")
    parser.add_argument("--repartition-cuts", default="auto", help="cut points after the morph, as --cuts; 'auto': the planner balances the new stages")
    parser.add_argument("--steps", type=int, default=100, help="training steps")
    parser.add_argument("--global-batch", type=int, default=0, help="sequences per step over all replicas (default: 2 per micro-batch and replica)")
    add_model_flags(parser, block_size=64)  # the model has n_layer + 2 pipeline blocks
    add_security_flags(parser)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any wait for a peer rank or a node may take before the rank stops with an error")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or summary (for launchers that collect --report)")
    parser.add_argument("--report", default="", help="directory for a JSON report per rank (losses, step times, bubble)")
    parser.add_argument("--save-params", default="", help="directory to save each rank's final parameters (rank{r}.pt, by name)")
    parser.add_argument("--crash-at-step", type=int, default=-1, help="fault injection for tests: --crash-rank exits abruptly (like kill -9) at this step")
    parser.add_argument("--crash-rank", type=int, default=-1, help="fault injection for tests: the rank that exits at --crash-at-step")
    return parser


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_recipe_args(build_parser(), argv)
    logging.basicConfig(level=os.environ.get("NETOPTIM_LOG_LEVEL", "WARNING"), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(max(1, args.threads))
    stages_per_rank = args.stages_per_rank or (2 if args.schedule == "interleaved" else 1)
    cuts = None if args.cuts == "auto" else tuple(int(c) for c in args.cuts.split(",") if c)
    config = PipelineConfig(args.stages, args.microbatches, args.schedule, stages_per_rank, cuts)
    config.validate()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    replicas = world // args.stages
    global_batch = args.global_batch or 2 * args.microbatches * replicas
    if global_batch % (replicas * args.microbatches):
        raise SystemExit(f"--global-batch {global_batch} must be a multiple of replicas x micro-batches = {replicas * args.microbatches}")
    torch.manual_seed(args.seed)  # every rank builds the same model; replica 0's values are registered
    model = GPT(model_config(args))
    tokens = load_stdlib_bytes()
    micro_batches = replicas * args.microbatches  # the calibration runs on one micro-batch
    sample_x, _ = batch_for_step(tokens, 0, global_batch=global_batch, block_size=args.block_size, rank=0, world_size=micro_batches, seed=args.seed)
    trainer = PipelineTrainer(
        model, token_loss, config, nodes=discover_nodes(nodes_option(args.nodes), timeout_s=args.timeout), calibration_input=sample_x, device=device, param_groups=decay_groups,
        lr=args.lr, betas=(0.9, 0.95), wire_dtype=WIRE_DTYPES[args.wire_dtype], timeout_s=args.timeout, **security_options(args, rank),
    )  # fmt: skip
    del model  # the blocks of other stages go; this rank keeps its own
    start_step = trainer.optimizer.remote_step
    schedule = lr_lambda(args.steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda step: schedule(step + start_step))
    losses: list[float] = []
    step_times: list[float] = []
    phases: list[tuple[float, float, float]] = []  # per step: compute, pipeline, optimizer seconds
    progress = tqdm(
        range(start_step, args.steps),
        **({"disable": True} if rank != 0 or args.quiet else {}),
        desc="training",
        unit="step",
        initial=start_step,
        total=args.steps,
        mininterval=0.5,
    )
    try:
        for step in progress:
            if step == args.crash_at_step and rank == args.crash_rank:
                os._exit(17)
            if step == args.repartition_at:
                stages = args.repartition_stages or args.stages
                cuts = None if args.repartition_cuts == "auto" else tuple(int(c) for c in args.repartition_cuts.split(",") if c)
                torch.manual_seed(args.seed)
                trainer.repartition(GPT(model_config(args)), PipelineConfig(stages, args.microbatches, args.schedule, stages_per_rank, cuts), sample_x)
                replicas = world // stages
                if global_batch % (replicas * args.microbatches):
                    raise SystemExit(f"--global-batch {global_batch} must be a multiple of replicas x micro-batches = {replicas * args.microbatches}")
                scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda s, base=step: schedule(s + base))
            x, y = batch_for_step(
                tokens, step, global_batch=global_batch, block_size=args.block_size, rank=trainer.replica, world_size=replicas, seed=args.seed
            )
            started = time.perf_counter()
            losses.append(trainer.step(x, y))
            scheduler.step()
            step_times.append(time.perf_counter() - started)
            phases.append((trainer.times.compute_s, trainer.times.pipeline_s, trainer.times.optimizer_s))
            progress.set_postfix(loss=f"{losses[-1]:.3f}", step_s=f"{step_times[-1]:.3f}")
    except (PipelineError, TimeoutError) as exc:
        log.error("%s", exc)
        print(f"rank {rank}: stopping: {exc}", flush=True)
        try:
            trainer.close()  # the nodes learn this rank left; the process group is left as it is (see below)
        except Exception as close_error:  # the status must still say why this rank stopped
            log.error("closing the optimizer after that failed too: %s", close_error)
        return 1
    finally:
        progress.close()
    if args.report:
        report = {
            "rank": rank, "position": trainer.position, "replica": trainer.replica, "stage_ranges": [trainer.stage_ranges[i] for i in trainer.stage_indices],
            "losses": losses, "step_s": step_times, "compute_s": [p[0] for p in phases], "pipeline_s": [p[1] for p in phases], "optimizer_s": [p[2] for p in phases],
        }  # fmt: skip
        Path(args.report).mkdir(parents=True, exist_ok=True)
        (Path(args.report) / f"rank{rank}.json").write_text(json.dumps(report))
    if args.save_params:
        Path(args.save_params).mkdir(parents=True, exist_ok=True)
        torch.save({name: p.detach().cpu().clone() for name, p in trainer.named_parameters()}, Path(args.save_params) / f"rank{rank}.pt")
    if rank == 0 and losses and not args.quiet:
        window = max(1, min(10, len(losses) // 4))
        print(
            f"loss: {sum(losses[:window]) / window:.3f} -> {sum(losses[-window:]) / window:.3f}; median step {statistics.median(step_times):.3f} s; "
            f"bubble on rank 0: {trainer.times.bubble_fraction:.2f}"
        )
    trainer.close()
    dist.destroy_process_group()
    return 0


def exit_after_a_broken_group(status: int) -> None:
    """Exit with ``status`` at once, skipping the interpreter's teardown: after a peer rank is gone
    the process group cannot be destroyed (its collectives wait on the dead link), and left to the
    interpreter's exit, gloo's threads were now and then still joinable when their C++ objects went,
    which aborts the process (SIGABRT, "terminate called without an active exception") instead of
    exiting with the status that says this rank stopped for a peer."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    code = main()
    if code:
        exit_after_a_broken_group(code)
    raise SystemExit(code)
