"""A job's step time, memory and node load on given hardware, from a calibration profile.

The profile (:class:`CostProfile`, written by ``netoptim plan --calibrate``) is the pipeline
planner's calibration (:class:`~netoptim.planning.planner.PlanCalibration`: blocks at several micro-batch
sizes, the runtime's overheads, a node's update measured through a real node with 1 and 2 workers,
its CPU split between the node and the workers) plus the node's update pass alone at 1 and 2
threads. :func:`estimate_step` puts a configuration (P, D, M, schedule, nodes per stage) on
:class:`Hardware`:

- pipeline: the discrete-event simulation of :mod:`netoptim.planning.simulate` with every block's calibrated
  time divided by the worker's speed, activations over the worker's link (bubbles included);
- update, per pipeline position ``p`` with ``n`` nodes, ``N = numel_p / n`` parameters each:
  ``t_node = c0 + N * (serial(D) + pass(D) / (1 + e * (cores - 1)))`` (node CPU per parameter,
  measured, with the update pass's share ``pass(D)`` spread over the node's cores at the measured
  efficiency ``e``), ``t_worker = w0 + numel_p * w`` (a worker's push and install),
  ``t_net = max(numel_p * 4 / worker_link, D * N * 4 / node_link)`` each way, pipelined over the
  ``B`` buckets: ``(t_worker + 2 t_net + t_node) / B + (1 - 1/B) * max(t_worker, t_net, t_node)``;
  the slowest position sets the update time;
- on one shared host (this machine: :func:`local_hardware`) everything also shares the cores: node
  and worker CPU times are scaled by the factor a real calibration run measured, and the update takes
  at least the CPU time of all of them over the cores;
- a link's transfers reach the efficiency measured on real links (``Hardware.*_link_efficiency``);
- memory: a rank holds its stage's parameters and gradients and the activations in flight; a node
  ``400 MiB + N * (12 + 4 D + 4)`` bytes (state, received gradients, values kept for restarts).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from gpu_worker.pipeline.balance import BlockCost
from netoptim.planning.planner import Candidate, OptimizerCost, PlanCalibration, predict
from protos.job.placement import default_bucket_numel

PROFILE_VERSION = 1
WIRE_BYTES = 4  # fp32 gradients and parameters on the wire
NODE_FIXED_BYTES = 400 << 20  # an idle node process, with headroom (as optimizer_node.state.memory_plan counts it)
NODE_STATE_BYTES_PER_PARAM = 12  # fp32 master and two moments


class ProfileError(ValueError):
    """A profile file that cannot be used."""


@dataclass(kw_only=True)
class CostProfile:
    """What the cost planner knows of a model, measured once on one machine."""

    pipeline: PlanCalibration
    """Blocks, link, node updates and the runtime's overheads (see :mod:`netoptim.planning.planner`)."""
    update_pass_s: dict[int, float]
    """Gradient terms -> seconds per parameter of the node's update pass alone, one thread."""
    thread_efficiency: float
    """What each update thread beyond the first adds, as a fraction of the first (measured 1 vs 2)."""
    shared_update_scale: float = 1.0
    """Measured update time in a real run on the shared host over :func:`estimate_step`'s."""
    device: str = ""
    """What one rank of the calibration ran on, in words (the unit of the catalog's ``gpu_speed``)."""

    def node_costs(self) -> NodeCosts:
        return NodeCosts.from_profile(self)

    def to_json(self) -> dict:
        return {
            "version": PROFILE_VERSION, "pipeline": self.pipeline.to_json(), "update_pass_s": self.update_pass_s,
            "thread_efficiency": self.thread_efficiency, "shared_update_scale": self.shared_update_scale, "device": self.device,
        }  # fmt: skip

    @classmethod
    def from_json(cls, raw: dict) -> CostProfile:
        if not isinstance(raw, dict) or raw.get("version") != PROFILE_VERSION:
            raise ProfileError(f"not a version-{PROFILE_VERSION} profile of netoptim plan --calibrate")
        try:
            profile = cls(
                pipeline=PlanCalibration.from_json(raw["pipeline"]),
                update_pass_s={int(k): float(v) for k, v in raw["update_pass_s"].items()},
                thread_efficiency=float(raw["thread_efficiency"]),
                shared_update_scale=float(raw.get("shared_update_scale", 1.0)),
                device=str(raw.get("device", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProfileError(f"a profile field is missing or malformed ({exc!r})") from None
        if not {1, 2} <= set(profile.pipeline.optimizer) or not {1, 2} <= set(profile.update_pass_s):
            raise ProfileError("the profile needs node updates measured with 1 and 2 workers")
        return profile


@dataclass(frozen=True)
class NodeCosts:
    """Per-parameter costs of an update, split between node and worker (from the profile)."""

    node_intercept_s: float
    node_per_param_s: tuple[float, float]  # node CPU per parameter with 1 and 2 gradient terms
    pass_per_param_s: tuple[float, float]  # of which the update pass, 1 thread
    worker_intercept_s: float
    worker_per_param_s: float
    thread_efficiency: float

    @classmethod
    def from_profile(cls, profile: CostProfile) -> NodeCosts:
        one, two = profile.pipeline.optimizer[1], profile.pipeline.optimizer[2]
        return cls(
            node_intercept_s=one.node_cpu_intercept_s,
            node_per_param_s=(one.node_cpu_per_param_s, two.node_cpu_per_param_s),
            pass_per_param_s=(profile.update_pass_s[1], profile.update_pass_s[2]),
            worker_intercept_s=max(0.0, one.cpu_intercept_s - one.node_cpu_intercept_s),
            worker_per_param_s=max(0.0, one.cpu_per_param_s - one.node_cpu_per_param_s),
            thread_efficiency=min(1.0, max(0.0, profile.thread_efficiency)),
        )

    def node_s(self, numel: float, terms: int, cores: float) -> float:
        """Seconds a node with ``cores`` update threads takes for ``numel`` parameters from ``terms`` workers."""
        per_param = _linear(self.node_per_param_s, terms)
        update = min(per_param, _linear(self.pass_per_param_s, terms))
        speedup = 1.0 + self.thread_efficiency * (max(1.0, cores) - 1.0)
        return self.node_intercept_s + numel * ((per_param - update) + update / speedup)

    def worker_s(self, numel: float) -> float:
        """CPU seconds a worker spends pushing ``numel`` gradients and installing the parameters."""
        return self.worker_intercept_s + numel * self.worker_per_param_s


def _linear(points: tuple[float, float], terms: int) -> float:
    """The line through the costs at 1 and 2 gradient terms, at ``terms`` (never decreasing)."""
    return points[0] + max(0.0, points[1] - points[0]) * (terms - 1)


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Where a configuration runs, as the step model sees it."""

    worker_speed: float = 1.0
    """Compute throughput of a rank over one rank of the calibration."""
    worker_link_bytes_per_s: float
    """Each rank's share of its machine's network (activations, gradients, parameters)."""
    node_link_bytes_per_s: float
    """Each node's network."""
    link_latency_s: float
    """One-way latency between machines."""
    node_cores: float = 1.0
    """Update threads of each node."""
    shared_cores: float | None = None
    """All ranks and nodes share these cores (one host); None: every rank has a device of its own
    and every node a machine of its own."""
    worker_link_efficiency: float = 1.0
    node_link_efficiency: float = 1.0
    """The share of a link's rate the update's transfers reach, when a worker's link or a node's
    bounds them (measured on real links: ``netoptim plan --cluster-calibration``; 1: ideal)."""


def local_hardware(profile: CostProfile) -> Hardware:
    """The calibration's own machine, as the benchmark runs it: ranks and one-thread nodes share its cores over loopback."""
    cal = profile.pipeline
    return Hardware(
        worker_link_bytes_per_s=cal.link_bytes_per_s, node_link_bytes_per_s=cal.link_bytes_per_s, link_latency_s=cal.link_latency_s, shared_cores=cal.cores
    )


@dataclass
class StepEstimate:
    """What :func:`estimate_step` predicts for one configuration."""

    candidate: Candidate
    step_s: float
    pipeline_s: float
    update_s: float
    update_cpu_s: float  # on shared cores: the CPU time of all nodes and workers over the cores
    network_s: float  # the slowest position's transfer time each way (part of update_s)
    node_s: float  # the slowest node's update time (part of update_s)
    bubble_fraction: float
    cuts: list[int]
    worker_memory_bytes: int
    node_memory_bytes: int
    params_per_node: int
    notes: list[str] = field(default_factory=list)


def fitted_blocks(calibration: PlanCalibration, micro: int) -> list[BlockCost]:
    """Every block's cost at micro-batch size ``micro``: as measured, else interpolated between the
    measured sizes (or extended along the last two), activation bytes in proportion."""
    sizes = sorted(calibration.block_costs)
    if micro in calibration.block_costs:
        return calibration.block_costs[micro]
    if micro < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {micro}")
    low = max((s for s in sizes if s < micro), default=None)
    high = min((s for s in sizes if s > micro), default=None)
    if low is None or high is None:
        ends = sizes[-2:] if high is None else sizes[:2]
        low, high = (ends[0], ends[-1]) if len(ends) == 2 else (0, ends[0])
    base = sizes[-1]

    def at(values: dict[int, float]) -> float:
        v_low = values.get(low, 0.0)
        slope = (values[high] - v_low) / (high - low)
        if slope <= 0:  # noise: proportional to the nearest measured size
            nearest = high if abs(high - micro) < abs(low - micro) or low == 0 else low
            return values[nearest] * micro / nearest
        return max(0.0, v_low + slope * (micro - low))

    blocks = []
    for index, reference in enumerate(calibration.block_costs[base]):
        forward = at({s: calibration.block_costs[s][index].forward_s for s in sizes})
        backward = at({s: calibration.block_costs[s][index].backward_s for s in sizes})
        blocks.append(BlockCost(forward, backward, reference.output_bytes * micro // base, reference.param_bytes, reference.saved_bytes * micro // base))
    return blocks


def node_memory_bytes(params: int, replicas: int) -> int:
    """RAM of a node owning ``params`` parameters of a full-model job with ``replicas`` workers pushing (fp32 wire)."""
    return NODE_FIXED_BYTES + params * (NODE_STATE_BYTES_PER_PARAM + replicas * WIRE_BYTES + WIRE_BYTES)


def estimate_step(profile: CostProfile, candidate: Candidate, global_batch: int, hardware: Hardware, *, bucket_bytes: int | None = None) -> StepEstimate:
    """Step time, memory per rank and per node of ``candidate`` on ``hardware`` (see the module's
    docstring), the job's gradients in buckets of ``bucket_bytes`` (default: a worker's default
    bucket for its share of the model and its stage's nodes, :func:`protos.job.placement.default_bucket_numel`)."""
    c = candidate
    if c.layerwise:
        raise ValueError("the cost model covers full-model pipelines, not layer-wise mode")
    if global_batch % (c.replicas * c.microbatches):
        raise ValueError(f"a global batch of {global_batch} does not split into {c.replicas} replicas x {c.microbatches} micro-batches")
    if hardware.worker_speed <= 0 or hardware.worker_link_bytes_per_s <= 0 or hardware.node_link_bytes_per_s <= 0:
        raise ValueError(f"worker speed and link bandwidths must be positive: {hardware}")
    micro = global_batch // (c.replicas * c.microbatches)
    cal = profile.pipeline
    shared = hardware.shared_cores is not None
    zero = {c.replicas: OptimizerCost(0.0, 0.0), 1: OptimizerCost(0.0, 0.0)}
    priced = dataclasses.replace(
        cal,
        block_costs={micro: fitted_blocks(cal, micro)},
        optimizer=zero,
        link_latency_s=hardware.link_latency_s,
        link_bytes_per_s=hardware.worker_link_bytes_per_s,
        compute_scale=(cal.compute_scale if shared else 1.0) / hardware.worker_speed,
        cores=hardware.shared_cores if shared else float(c.stages),
    )
    # replicas that share nothing run the same pipeline: simulate one
    simulated = c if shared else dataclasses.replace(c, replicas=1)
    pipeline = predict(priced, simulated, global_batch if shared else global_batch // c.replicas)
    costs = priced.block_costs[micro]
    total_stages = c.stages * c.stages_per_rank
    bounds = [0, *pipeline.cuts, len(costs)]
    stage_numel = [sum(x.param_bytes for x in costs[bounds[s] : bounds[s + 1]]) // 4 for s in range(total_stages)]
    position_numel = [sum(stage_numel[s] for s in range(p, total_stages, c.stages)) for p in range(c.stages)]
    nodes = profile.node_costs()
    node_cores = 1.0 if shared else hardware.node_cores
    cpu_scale = profile.shared_update_scale if shared else 1.0
    walls, cpu, worst_net, worst_node = [], 0.0, 0.0, 0.0
    for numel in position_numel:
        per_node = math.ceil(numel / c.nodes_per_stage)
        # on the shared host, the CPU parts as a real run there measured them (the links are not scaled)
        t_node = cpu_scale * nodes.node_s(per_node, c.replicas, node_cores)
        t_worker = cpu_scale * nodes.worker_s(numel)
        t_net = max(
            numel * WIRE_BYTES / (hardware.worker_link_bytes_per_s * hardware.worker_link_efficiency),
            c.replicas * per_node * WIRE_BYTES / (hardware.node_link_bytes_per_s * hardware.node_link_efficiency),
        )
        bucket = bucket_bytes or WIRE_BYTES * default_bucket_numel(numel, c.nodes_per_stage)
        buckets = max(1, math.ceil(per_node * WIRE_BYTES / bucket))
        slowest = max(t_worker, t_net, t_node)
        walls.append((t_worker + 2 * t_net + t_node) / buckets + (1 - 1 / buckets) * slowest + 2 * hardware.link_latency_s)
        cpu += c.nodes_per_stage * t_node + c.replicas * t_worker
        worst_net, worst_node = max(worst_net, t_net), max(worst_node, t_node)
    update_s = max(walls)
    update_cpu_s = cpu / hardware.shared_cores if hardware.shared_cores else 0.0
    if shared:  # at least the CPU all processes need
        update_s = max(update_s, update_cpu_s)
    step_s = pipeline.pipeline_s + update_s + cal.step_overhead_s
    params_per_node = max(math.ceil(n / c.nodes_per_stage) for n in position_numel)
    return StepEstimate(
        candidate=c, step_s=step_s, pipeline_s=pipeline.pipeline_s, update_s=update_s, update_cpu_s=update_cpu_s, network_s=worst_net, node_s=worst_node,
        bubble_fraction=pipeline.bubble_fraction, cuts=pipeline.cuts, worker_memory_bytes=pipeline.peak_memory_bytes,
        node_memory_bytes=node_memory_bytes(params_per_node, c.replicas), params_per_node=params_per_node,
    )  # fmt: skip
