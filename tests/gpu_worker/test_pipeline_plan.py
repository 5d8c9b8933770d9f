"""Pipeline building blocks in one process: splitting, balancing, schedules, the simulator, the
planner, and the runtime's refusals (on a one-rank gloo group and a real node)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpu_worker.models import GPT, GPTConfig
from gpu_worker.pipeline import BlockCost, PipelineConfig, PipelineTrainer, StageModule, balance, calibrate, pipeline_blocks, split_points
from netoptim.planning.planner import Candidate, OptimizerCost, PlanCalibration, candidates, in_flight, plan, predict
from netoptim.planning.simulate import BACKWARD, FORWARD, StageCosts, schedule_order, simulate

CONFIG = GPTConfig(block_size=8, n_layer=3, n_embd=16, n_head=2)


def test_gpt_blocks_keep_the_model_names_and_compute_the_same_logits():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    blocks = pipeline_blocks(model)
    assert len(blocks) == CONFIG.n_layer + 2
    assert [n for b in blocks for n, _ in b.named_parameters()] == [n for n, _ in model.named_parameters()]
    idx = torch.randint(0, 256, (2, 8))
    first, second = StageModule(blocks[:2]), StageModule(blocks[2:])
    assert torch.equal(second(first(idx)), model(idx)[0]), "a split model computes exactly what the whole one does"


def test_models_that_cannot_be_split_are_refused_clearly():
    with pytest.raises(TypeError, match="pipeline_blocks"):
        pipeline_blocks(nn.Linear(4, 4))
    shared = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="tied weights across blocks"):
        pipeline_blocks(nn.Sequential(shared, nn.ReLU(), shared))
    with pytest.raises(ValueError, match="has no blocks"):
        pipeline_blocks(nn.Sequential())


@pytest.mark.parametrize(
    ("cuts", "stages", "message"), [([2], 3, "3 stages need 2 cut points"), ([3, 2], 3, "increasing"), ([0], 2, "increasing"), ([5], 2, "increasing")]
)
def test_bad_cut_points_are_refused(cuts, stages, message):
    with pytest.raises(ValueError, match=message):
        split_points(5, cuts, stages)


def cost(seconds: float, param_bytes: int = 100, saved: int = 10) -> BlockCost:
    return BlockCost(seconds / 3, 2 * seconds / 3, 64, param_bytes, saved)


def test_balance_minimizes_the_slowest_stage_and_respects_memory():
    costs = [cost(t) for t in (1, 1, 1, 3, 1, 1)]
    assert balance(costs, 2) == [3]  # 3 | 5
    assert balance(costs, 3) == [3, 4]  # 3 | 3 | 2
    with pytest.raises(ValueError, match="each stage needs at least one block"):
        balance(costs, 7)
    with pytest.raises(ValueError, match="fits 150 bytes per stage"):
        balance([cost(1, param_bytes=100)] * 4, 2, max_stage_bytes=150)
    assert balance([cost(1, param_bytes=100), cost(10, param_bytes=100), cost(1, param_bytes=100)], 2, max_stage_bytes=230) == [1]


def test_calibration_measures_every_block_and_leaves_gradients_alone():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    costs = calibrate(pipeline_blocks(model), torch.randint(0, 256, (2, 8)), repeats=1)
    assert len(costs) == CONFIG.n_layer + 2 and all(c.forward_s > 0 and c.backward_s > 0 for c in costs)
    assert costs[1].output_bytes == 2 * 8 * 16 * 4 and costs[1].saved_bytes > costs[1].output_bytes
    assert costs[-1].param_bytes == (16 * 256 + 2 * 16) * 4
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(("schedule", "stages_per_rank"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_schedules_run_every_microbatch_once_each_way(schedule, stages_per_rank):
    positions, microbatches = 4, 8
    for position in range(positions):
        order = schedule_order(schedule, position, positions, microbatches, stages_per_rank)
        local = [position + positions * v for v in range(stages_per_rank)]
        for kind in (FORWARD, BACKWARD):
            assert sorted((a.stage, a.microbatch) for a in order if a.kind == kind) == sorted((s, m) for s in local for m in range(microbatches))
    assert in_flight("gpipe", 0, 4, 8, 1) == [8]
    assert [in_flight("1f1b", p, 4, 8, 1) for p in range(4)] == [[4], [3], [2], [1]]


@pytest.mark.parametrize(("schedule", "stages_per_rank"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_simulated_bubble_is_the_schedules_theoretical_one(schedule, stages_per_rank):
    positions, microbatches = 4, 8
    stages = [StageCosts(1.0, 2.0, 0)] * (positions * stages_per_rank)
    sim = simulate(
        schedule=schedule, stages=stages, num_positions=positions, num_replicas=1, num_microbatches=microbatches, stages_per_rank=stages_per_rank,
        cores=64, link_latency_s=0.0, link_bytes_per_s=1e12, action_overhead_s=0.0, optimizer_work_s=[],
    )  # fmt: skip
    theory = (positions - 1) / (stages_per_rank * microbatches + positions - 1)
    assert sim.bubble_fraction == pytest.approx(theory, abs=1e-9)


def test_ranks_sharing_too_few_cores_slow_each_other_down():
    def step(cores: float) -> float:
        return simulate(
            schedule="gpipe", stages=[StageCosts(1.0, 1.0, 0)], num_positions=1, num_replicas=2, num_microbatches=1, stages_per_rank=1,
            cores=cores, link_latency_s=0.0, link_bytes_per_s=1e12, action_overhead_s=0.0, optimizer_work_s=[(0.5, 1.0), (0.5, 1.0)],
        ).step_s  # fmt: skip

    assert step(2) == pytest.approx(2.0 + 1.0)  # the two updates need 2 CPU-seconds on 2 cores
    assert step(1) == pytest.approx(4.0 + 2.0)


def synthetic_calibration() -> PlanCalibration:
    blocks = [cost(0.01, param_bytes=4000, saved=1000)] * 6
    return PlanCalibration(
        block_costs={1: blocks, 2: [cost(0.02, 4000, 2000)] * 6, 4: [cost(0.04, 4000, 4000)] * 6},
        link_latency_s=1e-5, link_bytes_per_s=1e9, optimizer={1: OptimizerCost(0.001, 1e-8, 0.001, 2e-8), 2: OptimizerCost(0.002, 2e-8, 0.002, 4e-8)}, cores=2.0,
    )  # fmt: skip


def test_candidates_cover_the_valid_configurations_only():
    found = candidates(4, 8, 6, 4)
    assert found and all(c.stages * c.replicas == 4 and 8 % (c.replicas * c.microbatches) == 0 for c in found)
    assert all(c.microbatches >= c.stages for c in found if c.schedule == "1f1b")
    assert all(c.microbatches % c.stages == 0 and c.stages > 1 for c in found if c.schedule == "interleaved")
    assert {c.stages for c in found} == {1, 2, 4} and any(c.layerwise for c in found)


def test_plan_ranks_by_predicted_time_and_drops_what_does_not_fit():
    calibration = synthetic_calibration()
    assert PlanCalibration.from_json(calibration.to_json()) == calibration
    ranked = plan(calibration, 2, 4, 2)
    assert [p.step_s for p in ranked] == sorted(p.step_s for p in ranked)
    limit = sorted(p.peak_memory_bytes for p in ranked)[len(ranked) // 2]
    assert all(p.peak_memory_bytes <= limit for p in plan(calibration, 2, 4, 2, memory_limit=limit))
    more = predict(calibration, Candidate(2, 1, 4, "1f1b"), 4)
    fewer = predict(calibration, Candidate(2, 1, 2, "1f1b"), 4)
    assert more.bubble_fraction < fewer.bubble_fraction and more.theoretical_bubble == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="no calibration at micro-batch size 8"):
        predict(calibration, Candidate(1, 1, 1, "gpipe"), 8)
    with pytest.raises(ValueError, match="does not split into 2 replicas x 2 micro-batches"):
        predict(calibration, Candidate(1, 2, 2, "gpipe"), 6)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (PipelineConfig(2, 1, "1f1b"), "at least as many micro-batches"),
        (PipelineConfig(2, 3, "interleaved", 2), "multiple of num_stages"),
        (PipelineConfig(2, 4, "interleaved", 1), "needs stages_per_rank >= 2"),
        (PipelineConfig(2, 4, "zigzag"), "not one of"),
        (PipelineConfig(0, 4), "num_stages must be >= 1"),
    ],
)
def test_bad_pipeline_configs_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        config.validate()


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def test_the_runtime_refuses_what_cannot_run_and_trains_one_stage_like_adamw(one_rank_group, node):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    loss = nn.MSELoss()
    with pytest.raises(ValueError, match="world size 1 is not a multiple of num_stages 2"):
        PipelineTrainer(model, loss, PipelineConfig(2, 2), nodes=[node.address, node.address], cuts=None)
    with pytest.raises(ValueError, match="cannot be dealt out to 1"):
        PipelineTrainer(model, loss, PipelineConfig(1, 2, "gpipe"), nodes="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="give cut points"):
        PipelineTrainer(model, loss, PipelineConfig(1, 2, "gpipe"), nodes=[node.address])
    reference = [p.detach().clone() for p in model.parameters()]
    trainer = PipelineTrainer(model, loss, PipelineConfig(1, 2, "gpipe", cuts=()), nodes=[node.address], lr=1e-2, weight_decay=0.0)
    x, y = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)), torch.randn(4, 2, generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        trainer.step(x, y)
    local = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with torch.no_grad():
        for p, value in zip(local.parameters(), reference, strict=True):
            p.copy_(value)
    opt = torch.optim.AdamW(local.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    for _ in range(3):
        for xm, ym in zip(x.tensor_split(2), y.tensor_split(2), strict=True):
            loss(local(xm), ym).backward()
        for p in local.parameters():
            p.grad.div_(2)
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(a, b) for (_, a), b in zip(trainer.named_parameters(), local.parameters(), strict=True))
    trainer.close()


def test_the_runtime_parameters_are_recovered_from_a_measured_pipeline_time():
    from netoptim.planning.planner import _pipeline_s, fit_action_overhead, fit_compute_scale

    calibration = synthetic_calibration()
    costs = calibration.block_costs[2]
    candidate = Candidate(2, 1, 4, "gpipe")
    measured = _pipeline_s(calibration, costs, candidate, [3], 0.002, 1.0)
    assert fit_action_overhead(calibration, costs, candidate, [3], measured) == pytest.approx(0.002, rel=1e-6)
    calibration.action_overhead_s = 0.002
    slower = _pipeline_s(calibration, costs, candidate, [3], 0.002, 1.3)
    assert fit_compute_scale(calibration, costs, candidate, [3], slower) == pytest.approx(1.3, rel=1e-6)
    assert fit_compute_scale(calibration, costs, candidate, [3], 100.0) == 4.0, "clamped, not extrapolated without bound"
