"""The node times its two update paths on a job's first updates and keeps the faster: the choice
itself, and a real node whose updates alternate between the compiled loop and torch ops while it
trains, bitwise equal to torch's fused AdamW throughout."""

from __future__ import annotations

import time

import grpc
import torch

from gpu_worker import RemoteAdamW
from optimizer_node.update.kernels import compiled_update
from optimizer_node.update.path_choice import (
    COMPILED_MARGIN,
    TRIAL_MAX_UPDATES,
    TRIAL_MIN_NUMEL,
    TRIAL_MIN_UPDATES,
    TRIAL_NUMEL,
    WARM_UPDATES,
    UpdatePathChoice,
)
from protos import admin_pb2, admin_pb2_grpc


def run_trial(compiled_s: float, torch_ops_s: float, numel: int = TRIAL_NUMEL // TRIAL_MIN_UPDATES) -> UpdatePathChoice:
    """Feed the choice updates that took ``compiled_s`` / ``torch_ops_s`` on the path it asked for,
    after each bucket's first WARM_UPDATES, which took 10 s: they fault fresh memory in and are not timed."""
    choice = UpdatePathChoice(enabled=True)
    asked = []
    for step in range(WARM_UPDATES + TRIAL_MIN_UPDATES):  # two buckets a step
        for bucket_id in range(2):
            compiled = choice.wants_compiled(bucket_id, step, numel)
            asked.append((bucket_id, compiled))
            choice.record(bucket_id, compiled, numel, 10.0 if step < WARM_UPDATES else compiled_s if compiled else torch_ops_s)
            assert (choice.chosen is None) == (step < WARM_UPDATES + TRIAL_MIN_UPDATES - 1 or bucket_id == 0)
    assert asked == [(0, True), (1, False), (0, False), (1, True)] * ((WARM_UPDATES + TRIAL_MIN_UPDATES) // 2), "each bucket takes each path in turn"
    return choice


def test_the_faster_path_is_kept_and_the_loop_wins_near_ties():
    assert compiled_update.usable(), "numba is a dependency: the loop must check out here"
    faster_ops = run_trial(compiled_s=0.010, torch_ops_s=0.008)
    assert faster_ops.chosen == "torch-ops" and not faster_ops.wants_compiled(0, 0, TRIAL_NUMEL)
    assert faster_ops.describe().startswith("torch-ops (compiled loop 419 Mparam/s, torch ops 524 Mparam/s, medians of this job's first 16 updates")
    assert run_trial(compiled_s=0.008, torch_ops_s=0.010).chosen == "compiled"
    assert run_trial(compiled_s=0.010, torch_ops_s=0.010 / (COMPILED_MARGIN - 0.01)).chosen == "compiled"


def test_small_buckets_and_an_out_of_core_node_take_no_part():
    assert compiled_update.usable()
    choice = UpdatePathChoice(enabled=True)
    for step in range(1000):
        assert choice.wants_compiled(0, step, TRIAL_MIN_NUMEL - 1), "small buckets take the loop throughout"
        choice.record(0, True, TRIAL_MIN_NUMEL - 1, 1.0)
    assert choice.chosen is None and choice.describe() == "compiled"
    never_compiled = UpdatePathChoice(enabled=True)  # e.g. clipping every step: the loop never takes an update
    for update in range(TRIAL_MAX_UPDATES + WARM_UPDATES):
        assert never_compiled.chosen is None
        never_compiled.record(update % 4, False, TRIAL_MIN_NUMEL, 1.0)  # four buckets, each's first WARM_UPDATES untimed
    for update in range(TRIAL_MAX_UPDATES + WARM_UPDATES, TRIAL_MAX_UPDATES + 4 * WARM_UPDATES):
        never_compiled.record(update % 4, False, TRIAL_MIN_NUMEL, 1.0)
    assert never_compiled.chosen == "torch-ops" and not never_compiled.wants_compiled(0, 0, TRIAL_NUMEL)
    out_of_core = UpdatePathChoice(enabled=False)
    out_of_core.record(0, True, TRIAL_NUMEL, 1.0)
    assert not out_of_core.wants_compiled(0, 0, TRIAL_NUMEL) and out_of_core.describe() == "torch-ops (out of core)"


def update_path(admin_address: str) -> str:
    with grpc.insecure_channel(admin_address) as channel:
        return admin_pb2_grpc.OptimizerNodeAdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(), timeout=10).update_path


def test_a_node_times_both_paths_while_it_trains_bitwise_and_keeps_one(start_node):
    node = start_node(extra_args=("--admin", "127.0.0.1:0"))
    numel, buckets = 8 << 20, 4  # each path updates half the buckets of a step: the trial takes 8 steps after 2 untimed
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(numel, generator=generator)
    grads = [torch.randn(numel, generator=generator) for _ in range(3)]
    offloaded = torch.nn.Parameter(start.clone())
    reference = torch.nn.Parameter(start.clone())
    opt = RemoteAdamW([offloaded], lr=1e-3, weight_decay=0.01, nodes=[node.address], rank=0, world_size=1, bucket_numel=numel // buckets, timeout_s=120)
    torch_adamw = torch.optim.AdamW([reference], lr=1e-3, weight_decay=0.01, fused=True)

    def step(index: int) -> None:
        for param, optimizer in ((offloaded, opt), (reference, torch_adamw)):
            param.grad = grads[index % len(grads)].clone()
            optimizer.step()

    try:
        step(0)  # the first update starts the loop's check: updates use torch ops until it is done
        deadline = time.monotonic() + 180
        while "checking" in update_path(node.admin_address) and time.monotonic() < deadline:
            time.sleep(0.2)
        steps = WARM_UPDATES + max(2 * TRIAL_NUMEL // numel, TRIAL_MIN_UPDATES)  # step 0 was a first update
        for index in range(1, steps + 1):
            step(index)
            assert torch.equal(offloaded.detach(), reference.detach()), f"step {index}: the paths must give the same bits"
        path = update_path(node.admin_address)
    finally:
        opt.close()
    assert path.startswith(("compiled (compiled loop ", "torch-ops (compiled loop ")), path
    assert "update path: " in node.log_text()
