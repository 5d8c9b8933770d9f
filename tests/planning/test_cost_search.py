"""The cost planner's step model and search, on a synthetic profile: each input moves the answer the
way it must, the deadline or budget is kept, and the choice is explained."""

from __future__ import annotations

import dataclasses

import pytest

from gpu_worker.pipeline.balance import BlockCost
from netoptim.planning.catalog import parse_catalog
from netoptim.planning.cost_model import CostProfile, Hardware, ProfileError, estimate_step, local_hardware, node_memory_bytes
from netoptim.planning.cost_search import Job, Option, Rental, hardware, lost_fraction, plan_cost, why
from netoptim.planning.planner import Candidate, OptimizerCost, PlanCalibration

MILLION = 1_000_000


def block(seconds: float, micro: int) -> BlockCost:
    # 10M parameters per block: the update matters next to the compute
    return BlockCost(seconds * micro / 3, seconds * micro * 2 / 3, 4096 * micro, 40 * MILLION, 100_000 * micro)


def profile() -> CostProfile:
    calibration = PlanCalibration(
        block_costs={m: [block(0.01, m)] * 6 for m in (1, 2, 4, 8)},
        link_latency_s=1e-5,
        link_bytes_per_s=1e9,
        optimizer={
            1: OptimizerCost(0.001, 2e-9, 0.002, 4e-9, node_cpu_intercept_s=0.001, node_cpu_per_param_s=2e-9),
            2: OptimizerCost(0.002, 3e-9, 0.003, 6e-9, node_cpu_intercept_s=0.001, node_cpu_per_param_s=3e-9),
        },
        cores=2.0,
    )
    return CostProfile(pipeline=calibration, update_pass_s={1: 1e-9, 2: 1.5e-9}, thread_efficiency=0.5, device="one CPU core")


CATALOG = """\
note = "test prices"
[[machine]]
name = "small-gpu"
price_per_hour = 1.0
spot_price_per_hour = 0.3
spot_preemptions_per_hour = 0.0
cpu_cores = 8
memory_gib = 64
gpu_kind = "S"
gpu_count = 1
gpu_memory_gib = 16
gpu_speed = 10.0
network_gbps = 10

[[machine]]
name = "big-gpu"
price_per_hour = 8.0
cpu_cores = 32
memory_gib = 256
gpu_kind = "B"
gpu_count = 4
gpu_memory_gib = 80
gpu_speed = 40.0
network_gbps = 100

[[machine]]
name = "cpu"
price_per_hour = 0.5
cpu_cores = 16
memory_gib = 64
network_gbps = 25
"""


def hw(**changes) -> Hardware:
    base = Hardware(worker_speed=10.0, worker_link_bytes_per_s=1.25e9, node_link_bytes_per_s=3e9, link_latency_s=5e-5, node_cores=16.0)
    return dataclasses.replace(base, **changes)


def test_the_profile_survives_json_and_a_bad_one_is_refused():
    p = profile()
    assert CostProfile.from_json(p.to_json()).to_json() == p.to_json()
    with pytest.raises(ProfileError, match="version"):
        CostProfile.from_json({"version": 99})
    raw = p.to_json()
    del raw["update_pass_s"]
    with pytest.raises(ProfileError, match="missing or malformed"):
        CostProfile.from_json(raw)


def test_each_machine_property_moves_the_step_the_way_it_must():
    p, c = profile(), Candidate(2, 2, 4, "1f1b", 1)
    base = estimate_step(p, c, 16, hw())
    faster_gpu = estimate_step(p, c, 16, hw(worker_speed=20.0))
    assert faster_gpu.pipeline_s < base.pipeline_s and faster_gpu.update_s == pytest.approx(base.update_s)
    slower_link = estimate_step(p, c, 16, hw(node_link_bytes_per_s=3e8, worker_link_bytes_per_s=1.25e8))
    assert slower_link.network_s > base.network_s and slower_link.step_s > base.step_s
    measured_links = estimate_step(p, c, 16, hw(node_link_efficiency=0.5, worker_link_efficiency=0.5))
    assert measured_links.network_s == pytest.approx(2 * base.network_s)
    fewer_cores = estimate_step(p, c, 16, hw(node_cores=1.0))
    assert fewer_cores.node_s > base.node_s
    two_nodes = estimate_step(p, dataclasses.replace(c, nodes_per_stage=2), 16, hw())
    assert two_nodes.params_per_node * 2 == pytest.approx(base.params_per_node, abs=1) and two_nodes.node_s < base.node_s
    assert base.node_memory_bytes == node_memory_bytes(base.params_per_node, 2)
    with pytest.raises(ValueError, match="does not split"):
        estimate_step(p, c, 6, hw())
    with pytest.raises(ValueError, match="layer-wise"):
        estimate_step(p, dataclasses.replace(c, layerwise=True), 16, hw())


def test_on_one_shared_host_the_update_is_bounded_by_the_cpu_all_processes_need():
    p = profile()
    shared = local_hardware(p)
    assert shared.shared_cores == 2.0
    one = estimate_step(p, Candidate(1, 1, 1, "gpipe", 1), 4, shared)
    four = estimate_step(p, Candidate(1, 4, 1, "gpipe", 1), 4, dataclasses.replace(shared, shared_cores=1.0))
    assert four.update_s > one.update_s and four.update_s >= four.update_cpu_s
    assert one.update_cpu_s > 0


def job(**changes) -> Job:
    return Job(**{"steps": 10_000, "global_batch": 16, "deadline_h": 10.0, **changes})


def test_a_deadline_gives_the_cheapest_option_that_meets_it_and_a_budget_the_fastest_within_it():
    catalog = parse_catalog(CATALOG, "c.toml")
    ranked, priced = plan_cost(profile(), catalog, job())
    assert ranked and all(o.hours <= 10.0 for o in ranked)
    assert [o.cost for o in ranked] == sorted(o.cost for o in ranked)
    assert ranked[0].cost == min(o.cost for o in priced if o.hours <= 10.0)
    fastest = min(o.hours for o in priced)
    tight, _ = plan_cost(profile(), catalog, job(deadline_h=fastest * 1.01))
    assert tight[0].hours <= fastest * 1.01 and tight[0].cost >= ranked[0].cost  # a tighter deadline costs at least as much
    budget = ranked[0].cost * 3
    within, _ = plan_cost(profile(), catalog, job(deadline_h=None, budget=budget))
    assert all(o.cost <= budget for o in within)
    assert [o.hours for o in within] == sorted(o.hours for o in within)
    assert within[0].hours <= ranked[0].hours
    # the cost is the time times the machines' prices
    best = ranked[0]
    assert best.cost == pytest.approx(best.hours * (best.workers.price_per_hour + best.nodes.price_per_hour))


def test_machines_too_small_for_the_model_are_never_chosen():
    catalog = parse_catalog(CATALOG.replace("gpu_memory_gib = 16", "gpu_memory_gib = 0.1"), "c.toml")
    _, priced = plan_cost(profile(), catalog, job())
    assert priced and all(o.workers.machine.name == "big-gpu" for o in priced)
    assert all(o.estimate.worker_memory_bytes <= o.workers.machine.gpu_memory_bytes for o in priced)


def test_spot_wins_when_it_is_rarely_taken_back_and_loses_when_it_often_is():
    catalog = parse_catalog(CATALOG, "c.toml")
    ranked, _ = plan_cost(profile(), catalog, job(deadline_h=1000.0))
    assert ranked[0].workers.spot and ranked[0].lost_fraction == 0.0  # never preempted: the cheaper price wins
    stormy = parse_catalog(CATALOG.replace("spot_preemptions_per_hour = 0.0", "spot_preemptions_per_hour = 30.0"), "c.toml")
    ranked, priced = plan_cost(profile(), stormy, job(deadline_h=1000.0))
    assert not ranked[0].workers.spot
    assert all(o.lost_fraction < 1.0 for o in priced)


def test_the_expected_loss_to_preemptions_follows_the_stated_model():
    catalog = parse_catalog(CATALOG.replace("spot_preemptions_per_hour = 0.0", "spot_preemptions_per_hour = 0.5"), "c.toml")
    gpu, cpu = catalog.workers[0], catalog.nodes[0]
    workers, nodes = Rental(gpu, 4, spot=True), Rental(cpu, 2, spot=False)
    j = job(replacement_s=600.0, morph_pause_steps=2.0)
    # 4 machines x 0.5/h x (2 steps of 1.5 s + 600 s / 4 replicas), over an hour
    assert lost_fraction(j, workers, nodes, replicas=4, step_s=1.5) == pytest.approx(4 * 0.5 * (3.0 + 150.0) / 3600)
    # one replica: the whole job waits for the replacement
    assert lost_fraction(j, workers, nodes, replicas=1, step_s=1.5) == pytest.approx(4 * 0.5 * (3.0 + 600.0) / 3600)
    link = hardware(Rental(catalog.workers[0], 2, spot=False), nodes)
    assert link.worker_link_bytes_per_s == gpu.network_bytes_per_s / gpu.gpu_count and link.node_cores == 16.0


def test_the_explanation_names_the_bound_and_the_alternatives():
    catalog = parse_catalog(CATALOG, "c.toml")
    ranked, priced = plan_cost(profile(), catalog, job())
    lines = why(ranked, priced, job(), "USD")
    assert lines[0].startswith("bounded by ")
    assert any("finish within 10 h" in line for line in lines)
    assert any(line.startswith("the next (") for line in lines)
    best: Option = ranked[0]
    assert best.label().startswith("workers ") and "P=" in best.label()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"deadline_h": None}, "exactly one"),
        ({"budget": 5.0}, "exactly one"),
        ({"deadline_h": -1.0}, "positive"),
        ({"steps": 0}, "must be >= 1"),
        ({"checkpoint_interval_s": 0.0}, "checkpoint_interval_s"),
    ],
)
def test_a_job_that_makes_no_sense_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        job(**changes)
