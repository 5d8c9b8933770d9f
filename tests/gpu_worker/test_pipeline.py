"""Pipeline runtime: P x D ranks as real processes (gloo), each pipeline position's parameters on its
own real optimizer node, against torch's AdamW in one process."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time

import pytest
import torch

from gpu_worker.models import GPT, GPTConfig
from netoptim.launch.processes import free_port, run_workers
from netoptim.recipes.stdlib_text import batch_for_step, load_stdlib_bytes
from netoptim.recipes.train_gpt import lr_lambda
from netoptim.recipes.train_gpt_pipeline import decay_groups, token_loss

STEPS = 4
MODEL = {"block_size": 16, "n_layer": 2, "n_embd": 32, "n_head": 2}
LR = 1e-2


def pipeline_args(nodes: list[str], stages: int, microbatches: int, schedule: str, global_batch: int, out) -> list[str]:
    return [
        "--nodes", ",".join(nodes), "--stages", str(stages), "--microbatches", str(microbatches), "--schedule", schedule,
        "--steps", str(STEPS), "--global-batch", str(global_batch), "--block-size", str(MODEL["block_size"]), "--n-layer", str(MODEL["n_layer"]),
        "--n-embd", str(MODEL["n_embd"]), "--n-head", str(MODEL["n_head"]), "--lr", str(LR), "--timeout", "30", "--save-params", str(out),
    ]  # fmt: skip


def reference(
    replicas: int, microbatches: int, global_batch: int, replicas_from: tuple[int, int] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(A) torch's fused AdamW fed the gradients the pipeline computes: per replica, micro-batch
    gradients accumulated and divided by their number (as the schedule does), then replicas summed
    in order and divided by their number (as the node does); (B) the whole batch in one pass.
    ``replicas_from``: (step, replicas) from that step on (a pipeline repartitioned to another depth)."""
    tokens = load_stdlib_bytes()
    results = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: a matrix product may sum in another order with more threads
    for whole in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**MODEL))
        named = list(model.named_parameters())
        opt = torch.optim.AdamW(decay_groups(named), lr=LR, betas=(0.9, 0.95), fused=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(STEPS))
        for step in range(STEPS):
            if whole:
                x, y = batch_for_step(tokens, step, global_batch=global_batch, block_size=MODEL["block_size"], rank=0, world_size=1, seed=0)
                token_loss(model(x)[0], y).backward()
            else:
                sums: list[torch.Tensor] = []
                width = replicas_from[1] if replicas_from is not None and step >= replicas_from[0] else replicas
                for replica in range(width):
                    copy_ = copy.deepcopy(model)
                    x, y = batch_for_step(tokens, step, global_batch=global_batch, block_size=MODEL["block_size"], rank=replica, world_size=width, seed=0)
                    for xm, ym in zip(x.tensor_split(microbatches), y.tensor_split(microbatches), strict=True):
                        token_loss(copy_(xm)[0], ym).backward()
                    grads = [p.grad.div_(microbatches) for p in copy_.parameters()]
                    sums = [g.clone() for g in grads] if not sums else [s + g for s, g in zip(sums, grads, strict=True)]
                for param, total in zip(model.parameters(), sums, strict=True):
                    param.grad = total / width
            opt.step()
            opt.zero_grad()
            scheduler.step()
        results.append({name: p.detach().clone() for name, p in model.named_parameters()})
    torch.set_num_threads(threads)
    return results[0], results[1]


def gathered(out, world_size: int, stages: int) -> dict[str, torch.Tensor]:
    """Every rank's final parameters, merged by name; replicas of one position must be identical."""
    merged: dict[str, torch.Tensor] = {}
    for rank in range(world_size):
        for name, value in torch.load(out / f"rank{rank}.pt").items():
            if name in merged:
                assert torch.equal(merged[name], value), f"replicas disagree on {name}"
            merged[name] = value
    return merged


@pytest.mark.parametrize(
    ("stages", "replicas", "microbatches", "schedule"),
    [
        pytest.param(2, 1, 2, "1f1b", id="P2-D1-1f1b"),
        pytest.param(2, 2, 2, "interleaved", id="P2-D2-interleaved", marks=pytest.mark.slow),
    ],  # GPipe: the one-stage case of test_pipeline_plan
)
def test_pipeline_matches_adamw_fed_the_same_microbatch_gradients(start_node, tmp_path, stages, replicas, microbatches, schedule):
    nodes = [start_node(f"node{i}").address for i in range(stages)]
    global_batch = 4 * replicas
    status = run_workers(pipeline_args(nodes, stages, microbatches, schedule, global_batch, tmp_path / "params"), stages * replicas,
                         module="netoptim.recipes.train_gpt_pipeline", timeout_s=180, quiet=True)  # fmt: skip
    assert status == 0
    params = gathered(tmp_path / "params", stages * replicas, stages)
    same_grads, whole_batch = reference(replicas, microbatches, global_batch)
    assert params.keys() == same_grads.keys(), "every parameter is trained by exactly one pipeline position"
    diff = max(float((params[n] - same_grads[n]).abs().max()) for n in params)
    diff_whole = max(float((params[n] - whole_batch[n]).abs().max()) for n in params)
    # What DDP over replicas x micro-batches ranks computes (each rank one micro-batch, gradients averaged):
    # its distance to the whole batch is the bar, since a sum in another order is all that differs.
    ddp, _ = reference(replicas * microbatches, 1, global_batch)
    diff_ddp = max(float((ddp[n] - whole_batch[n]).abs().max()) for n in params)
    print(
        f"\nP={stages} D={replicas} M={microbatches} {schedule}: vs AdamW on the same micro-batch gradients {diff:.3g}, "
        f"vs whole batch {diff_whole:.3g} (DDP-equivalent vs whole batch {diff_ddp:.3g})"
    )
    assert diff == 0.0, "the same gradients through the same fused AdamW kernel: bitwise equal"
    assert diff_whole <= max(2 * diff_ddp, 1e-6)


@pytest.mark.slow  # ~30 s; tests/faults/test_no_hang.py keeps a killed rank stopping the others in the default run
def test_a_rank_that_dies_stops_every_other_rank(start_node, tmp_path):
    """Rank 1 (position 1 of replica 0) exits abruptly at step 2. Nothing stops the others for it (no
    torchrun here): its pipeline peer must fail on the broken link and the other replica's ranks on the
    all-reduce that checks every rank each step, each with an error naming itself, in bounded time."""
    nodes = [start_node(f"node{i}").address for i in range(2)]
    args = [*pipeline_args(nodes, 2, 2, "1f1b", 8, tmp_path / "params"), "--crash-at-step", "2", "--crash-rank", "1", "--quiet"]
    args[args.index("--steps") + 1] = "50"
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "4", "OMP_NUM_THREADS": "1"}
    ranks = []
    for rank in range(4):
        out = open(tmp_path / f"rank{rank}.out", "w")
        env = {**os.environ, **rendezvous, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        ranks.append(
            (subprocess.Popen([sys.executable, "-m", "netoptim.recipes.train_gpt_pipeline", *args], env=env, stdout=out, stderr=subprocess.STDOUT), out)
        )
    try:
        deadline = time.monotonic() + 90
        while any(p.poll() is None for p, _ in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        statuses = [p.poll() for p, _ in ranks]
    finally:
        for process, out in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
            out.close()
    assert None not in statuses, f"ranks still running after 90 s: {statuses}"
    assert statuses[1] == 17 and all(statuses[r] == 1 for r in (0, 2, 3)), statuses
    for rank, position, replica in ((0, 0, 0), (2, 0, 1), (3, 1, 1)):
        text = (tmp_path / f"rank{rank}.out").read_text()
        assert f"rank {rank}: stopping: rank {rank} (position {position}, replica {replica}): a peer rank stopped" in text, text[-2000:]


@pytest.mark.parametrize(
    ("stages_after", "cuts_before", "cuts_after"),
    [
        pytest.param(2, "1", "2", id="P2-new-cuts"),
        pytest.param(1, "2", "auto", id="P2-to-P1D2", marks=pytest.mark.slow),
    ],
)
def test_a_pipeline_repartitioned_mid_run_continues_bitwise(start_node, tmp_path, stages_after, cuts_before, cuts_after):
    """Morph P: before step 2 the pipeline takes another split (and maybe another depth, the replicas
    following); its state moves between the node groups' jobs, and the run is bitwise that of torch's
    AdamW fed the gradients of the split in force at each step."""
    nodes = [start_node(f"node{i}").address for i in range(2)]
    global_batch, microbatches, at = 4, 2, 2
    args = pipeline_args(nodes, 2, microbatches, "1f1b", global_batch, tmp_path / "params")
    args += ["--cuts", cuts_before, "--repartition-at", str(at), "--repartition-stages", str(stages_after), "--repartition-cuts", cuts_after]
    status = run_workers(args, 2, module="netoptim.recipes.train_gpt_pipeline", timeout_s=180, quiet=True)
    assert status == 0
    params = gathered(tmp_path / "params", 2, stages_after)
    replicas_after = 2 // stages_after
    expected, _ = reference(1, microbatches, global_batch, replicas_from=(at, replicas_after))
    assert params.keys() == expected.keys()
    assert max(float((params[n] - expected[n]).abs().max()) for n in params) == 0.0
