"""``netoptim plan``: rank the configurations of a job by simulated step time, from a calibration.

A :class:`PlanCalibration` holds what was measured on this machine: each block's forward and backward
time at every micro-batch size the candidates use, the bytes a stage boundary sends, the loopback
link's latency and bandwidth, and how long an optimizer node group takes to update ``n`` parameters
for ``D`` replicas. :func:`predict` turns a :class:`Candidate` into a step time with
:func:`~netoptim.planning.simulate.simulate` and into the memory each rank needs.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from gpu_worker.pipeline.balance import BlockCost, balance
from netoptim.planning.simulate import FORWARD, Simulation, StageCosts, schedule_order, simulate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimizerCost:
    """One node group's update of ``n`` parameters with ``replicas`` workers pushing: wall seconds
    ``intercept_s + per_param_s * n`` when it has the machine to itself, and the CPU seconds it
    spends (workers' copies, the node's reduction and AdamW), which is what concurrent updates share;
    ``node_cpu_*`` the part of those CPU seconds the node process spent (the cost planner's split
    between a node's machine and the workers')."""

    intercept_s: float
    per_param_s: float
    cpu_intercept_s: float = 0.0
    cpu_per_param_s: float = 0.0
    node_cpu_intercept_s: float = 0.0
    node_cpu_per_param_s: float = 0.0

    def seconds(self, numel: int) -> float:
        return self.intercept_s + self.per_param_s * numel

    def cpu_seconds(self, numel: int) -> float:
        return self.cpu_intercept_s + self.cpu_per_param_s * numel


@dataclass
class PlanCalibration:
    """Everything :func:`predict` needs, measured once (see ``netoptim plan``)."""

    block_costs: dict[int, list[BlockCost]]  # micro-batch size -> per block
    link_latency_s: float
    link_bytes_per_s: float
    optimizer: dict[int, OptimizerCost]  # replicas -> cost of one node group's update
    cores: float
    action_overhead_s: float = 0.0  # the runtime's own cost per forward or backward action (p2p, Python)
    compute_scale: float = 1.0  # compute inside a real pipeline over the same blocks measured alone
    step_overhead_s: float = 0.0  # per step, outside the pipeline and the update
    optimizer_scale: float = 1.0  # measured update time in a real run over the node calibration's
    calibration_run: tuple[int, int, int, str] = (0, 0, 0, "")  # (P, D, M, schedule) of that run
    model: dict[str, int] = field(default_factory=dict)  # the shape of the model measured (GPTConfig fields)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict) -> PlanCalibration:
        return cls(
            block_costs={int(k): [BlockCost(**c) for c in v] for k, v in raw["block_costs"].items()},
            link_latency_s=raw["link_latency_s"],
            link_bytes_per_s=raw["link_bytes_per_s"],
            optimizer={int(k): OptimizerCost(**v) for k, v in raw["optimizer"].items()},
            cores=raw["cores"],
            action_overhead_s=raw.get("action_overhead_s", 0.0),
            compute_scale=raw.get("compute_scale", 1.0),
            step_overhead_s=raw.get("step_overhead_s", 0.0),
            optimizer_scale=raw.get("optimizer_scale", 1.0),
            calibration_run=tuple(raw.get("calibration_run", (0, 0, 0, ""))),
            model=dict(raw.get("model", {})),
        )


@dataclass(frozen=True)
class Candidate:
    """One way to run the job: ``stages x replicas`` workers, ``microbatches`` per replica and step."""

    stages: int
    replicas: int
    microbatches: int
    schedule: str
    nodes_per_stage: int = 1
    layerwise: bool = False

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.schedule == "interleaved" else 1

    def label(self) -> str:
        mode = ", layer-wise" if self.layerwise else ""
        return f"P={self.stages} D={self.replicas} M={self.microbatches} {self.schedule}, {self.nodes_per_stage} node(s) per stage{mode}"


@dataclass
class Prediction:
    candidate: Candidate
    step_s: float
    pipeline_s: float
    optimizer_s: float
    bubble_fraction: float
    theoretical_bubble: float
    cuts: list[int]
    peak_memory_bytes: int  # the most any rank needs (parameters, gradients, activations in flight)
    samples_per_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def candidates(num_workers: int, global_batch: int, num_blocks: int, num_nodes: int, *, max_microbatches: int = 16) -> list[Candidate]:
    """Every configuration of ``num_workers`` workers and ``num_nodes`` optimizer nodes for the batch."""
    found = []
    for stages in range(1, num_workers + 1):
        if num_workers % stages or stages > num_blocks or stages > num_nodes:
            continue
        replicas = num_workers // stages
        microbatches = 1
        while microbatches <= max_microbatches:
            if global_batch % (replicas * microbatches) == 0:
                schedules = ["gpipe"] if stages == 1 or microbatches < stages else ["gpipe", "1f1b"]
                if stages > 1 and microbatches % stages == 0 and 2 * stages <= num_blocks:
                    schedules.append("interleaved")
                found += [Candidate(stages, replicas, microbatches, s, num_nodes // stages) for s in schedules]
                if stages == 1 and microbatches == 1:
                    found.append(Candidate(1, replicas, 1, "gpipe", num_nodes, layerwise=True))
            microbatches *= 2
    return found


def in_flight(schedule: str, position: int, stages: int, microbatches: int, stages_per_rank: int) -> list[int]:
    """Per local stage, the most micro-batches whose activations it holds at once under ``schedule``."""
    live: dict[int, int] = {}
    peak: dict[int, int] = {}
    for action in schedule_order(schedule, position, stages, microbatches, stages_per_rank):
        live[action.stage] = live.get(action.stage, 0) + (1 if action.kind == FORWARD else -1)
        peak[action.stage] = max(peak.get(action.stage, 0), live[action.stage])
    return [peak[s] for s in sorted(peak)]


def stage_costs(costs: Sequence[BlockCost], cuts: Sequence[int]) -> list[StageCosts]:
    """Per stage: the sums of its blocks' forward and backward times, and its last block's output bytes."""
    return [
        StageCosts(sum(x.forward_s for x in costs[a:b]), sum(x.backward_s for x in costs[a:b]), costs[b - 1].output_bytes)
        for a, b in itertools.pairwise([0, *cuts, len(costs)])
    ]


def predict(calibration: PlanCalibration, candidate: Candidate, global_batch: int, cuts: Sequence[int] | None = None) -> Prediction:
    """Simulated step time and memory of ``candidate`` (cut points balanced on the calibration unless given)."""
    c = candidate
    if global_batch % (c.replicas * c.microbatches):
        raise ValueError(f"a global batch of {global_batch} does not split into {c.replicas} replicas x {c.microbatches} micro-batches")
    micro = global_batch // (c.replicas * c.microbatches)
    if micro not in calibration.block_costs:
        raise ValueError(f"no calibration at micro-batch size {micro}; calibrate with it (have {sorted(calibration.block_costs)})")
    costs = calibration.block_costs[micro]
    total_stages = c.stages * c.stages_per_rank
    cuts = list(cuts) if cuts is not None else balance(costs, total_stages)
    ranges = list(itertools.pairwise([0, *cuts, len(costs)]))
    param_bytes = [sum(x.param_bytes for x in costs[a:b]) for a, b in ranges]
    saved = [sum(x.saved_bytes for x in costs[a:b]) for a, b in ranges]
    optimizer = calibration.optimizer.get(c.replicas)
    if optimizer is None:
        raise ValueError(f"no optimizer calibration for {c.replicas} replicas (have {sorted(calibration.optimizer)})")
    work = []
    scale = calibration.optimizer_scale
    for position in range(c.stages):
        numel = math.ceil(sum(param_bytes[s] for s in range(position, total_stages, c.stages)) // 4 / c.nodes_per_stage)
        work += [(scale * optimizer.seconds(numel), scale * optimizer.cpu_seconds(numel))] * c.nodes_per_stage
    notes = []
    if c.layerwise:
        sim = _simulate_layerwise(calibration, costs, c, work)
        notes.append("layer-wise: block time = max(compute, fetch), prefetch 1")
        # one block computing and one prefetched, with their gradients, plus a micro-batch's activations
        peak = 2 * 2 * max(x.param_bytes for x in costs) + sum(saved)
    else:
        sim = simulate(
            schedule=c.schedule, stages=stage_costs(costs, cuts), num_positions=c.stages, num_replicas=c.replicas, num_microbatches=c.microbatches,
            stages_per_rank=c.stages_per_rank, cores=calibration.cores, link_latency_s=calibration.link_latency_s,
            link_bytes_per_s=calibration.link_bytes_per_s, action_overhead_s=calibration.action_overhead_s, optimizer_work_s=work,
            compute_scale=calibration.compute_scale,
        )  # fmt: skip
        peak = 0
        for position in range(c.stages):
            local = list(range(position, total_stages, c.stages))
            flights = in_flight(c.schedule, position, c.stages, c.microbatches, c.stages_per_rank)
            peak = max(peak, sum(2 * param_bytes[s] + saved[s] * n for s, n in zip(local, flights, strict=True)))
    v = c.stages_per_rank
    theoretical = (c.stages - 1) / (v * c.microbatches + c.stages - 1)
    step_s = sim.step_s + calibration.step_overhead_s
    return Prediction(c, step_s, sim.pipeline_s, sim.optimizer_s, sim.bubble_fraction, theoretical, cuts, int(peak), global_batch / step_s, notes)


def _simulate_layerwise(calibration: PlanCalibration, costs: Sequence[BlockCost], c: Candidate, work: Sequence[tuple[float, float]]) -> Simulation:
    """Layer-wise data parallelism (P = 1): each block's parameters are fetched before its forward and
    again before its backward, overlapped with the previous block's compute, and its gradients pushed
    after. The step is the longer of that critical path and the time the cores need for all the CPU
    work: the ranks' compute plus the update's, with the transfers of 3 model copies per step instead
    of full mode's 2 (a fetch more). A model, not validated by ``bench plan`` (which runs pipelines)."""
    fetch = [calibration.link_latency_s + x.param_bytes / calibration.link_bytes_per_s for x in costs]
    forward = sum(max(x.forward_s, f) for x, f in zip(costs, fetch, strict=True))
    backward = sum(max(x.backward_s, 2 * f) for x, f in zip(costs, fetch, strict=True))
    compute = sum(x.compute_s for x in costs)
    cpu = c.replicas * compute + 1.5 * sum(cpu for _, cpu in work)
    tail = max(wall for wall, _ in work) / len(costs)  # the last block's update after the backward
    step = max(forward + backward, cpu / calibration.cores) + tail
    return Simulation(step, step - tail, tail, tuple(compute for _ in range(c.replicas)))


def fit_action_overhead(
    calibration: PlanCalibration, costs: Sequence[BlockCost], candidate: Candidate, cuts: Sequence[int], measured_pipeline_s: float
) -> float:
    """The per-action overhead with which the simulated pipeline of ``candidate`` (blocks ``costs``,
    at the calibration's compute scale) takes ``measured_pipeline_s``."""
    return _bisect(
        lambda overhead: _pipeline_s(calibration, costs, candidate, cuts, overhead, calibration.compute_scale),
        measured_pipeline_s,
        0.0,
        max(measured_pipeline_s, 1e-6),
    )


def fit_compute_scale(calibration: PlanCalibration, costs: Sequence[BlockCost], candidate: Candidate, cuts: Sequence[int], measured_pipeline_s: float) -> float:
    """The scale on calibrated compute with which the simulated pipeline (at the calibration's
    per-action overhead) takes ``measured_pipeline_s``; within [0.25, 4]."""
    return _bisect(lambda scale: _pipeline_s(calibration, costs, candidate, cuts, calibration.action_overhead_s, scale), measured_pipeline_s, 0.25, 4.0)


def _pipeline_s(calibration: PlanCalibration, costs: Sequence[BlockCost], candidate: Candidate, cuts: Sequence[int], overhead: float, scale: float) -> float:
    return simulate(
        schedule=candidate.schedule, stages=stage_costs(costs, cuts), num_positions=candidate.stages, num_replicas=candidate.replicas,
        num_microbatches=candidate.microbatches, stages_per_rank=candidate.stages_per_rank, cores=calibration.cores,
        link_latency_s=calibration.link_latency_s, link_bytes_per_s=calibration.link_bytes_per_s, action_overhead_s=overhead,
        optimizer_work_s=[], compute_scale=scale,
    ).pipeline_s  # fmt: skip


def _bisect(function: Callable[[float], float], target: float, low: float, high: float) -> float:
    """The ``x`` in [low, high] where the increasing ``function`` reaches ``target`` (clamped)."""
    if function(low) >= target:
        return low
    if function(high) <= target:
        return high
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if function(middle) < target else (low, middle)
    return (low + high) / 2


def plan(calibration: PlanCalibration, num_workers: int, global_batch: int, num_nodes: int, *, memory_limit: int | None = None) -> list[Prediction]:
    """Every candidate that can run with the calibration at hand, fastest first; those over
    ``memory_limit`` per rank are dropped."""
    num_blocks = len(next(iter(calibration.block_costs.values())))
    predictions = []
    uncalibrated = []
    for candidate in candidates(num_workers, global_batch, num_blocks, num_nodes):
        micro = global_batch // (candidate.replicas * candidate.microbatches)
        if micro not in calibration.block_costs or candidate.replicas not in calibration.optimizer:
            uncalibrated.append(candidate.label())
            continue
        prediction = predict(calibration, candidate, global_batch)
        if memory_limit is None or prediction.peak_memory_bytes <= memory_limit:
            predictions.append(prediction)
    if uncalibrated:
        log.warning(
            "%d configuration(s) left out, the calibration has no measurement for them (calibrate again for this batch and worker count): %s",
            len(uncalibrated),
            "; ".join(uncalibrated),
        )
    return sorted(predictions, key=lambda p: p.step_s)
