"""The cost planner: which machines, how many, and which P x D x M meet a deadline at the lowest cost
(or train fastest within a budget), from a calibrated profile and a machine catalog.

For every worker type and count, node type and count, on-demand or spot, and every pipeline
configuration of those ranks, :func:`~netoptim.planning.cost_model.estimate_step` predicts the step time and
the memory a rank and a node need; configurations that do not fit are dropped. Time to train is
``steps x step time``, stretched by what preemptions cost on spot machines (an expected-value model):

- a worker taken back costs the job's morph pause (the surviving workers agree on a new width at a
  step boundary: ``morph_pause_steps`` steps) and, until a replacement joins after
  ``replacement_s``, the lost width's share of the throughput (all of it with one replica: the
  pipeline waits);
- a node taken back loses the work since its last checkpoint (half the interval on average) and
  waits ``replacement_s`` for a new machine to resume from the checkpoint.

With preemptions at ``lambda`` per machine-hour and those costs ``c`` seconds each, a fraction
``f = sum(lambda * machines * c) / 3600`` of every hour is lost: time to train = ideal / (1 - f).
Cost = time x the machines' hourly prices.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from netoptim.planning.catalog import Catalog, MachineType
from netoptim.planning.cost_model import CostProfile, Hardware, StepEstimate, estimate_step
from netoptim.planning.planner import candidates


@dataclass(frozen=True, kw_only=True)
class Job:
    """What is to be trained, and the rules of the search."""

    steps: int
    """Optimizer steps to train for."""
    global_batch: int
    """Sequences per step over all replicas."""
    deadline_h: float | None = None
    """Finish within this many hours (then: the cheapest)."""
    budget: float | None = None
    """Spend at most this much (then: the fastest)."""
    max_machines: int = 16
    """The most machines of one role (worker or node) a configuration may rent."""
    max_microbatches: int = 16
    """The most micro-batches per replica tried."""
    replacement_s: float = 300.0
    """Seconds until a preempted machine's replacement is up and has joined."""
    morph_pause_steps: float = 2.0
    """Steps a data-parallel morph costs the job (``netoptim bench morph`` measures it)."""
    checkpoint_interval_s: float = 1800.0
    """Seconds between the nodes' checkpoints (what a preempted node loses: half of it)."""
    spot_nodes: bool = False
    """Also try optimizer nodes on spot machines (they restart from checkpoints when taken back)."""
    worker_link_efficiency: float = 1.0
    node_link_efficiency: float = 1.0
    """The share of a link's rate netoptim's transfers reach when a worker's or a node's link bounds
    them (from netoptim.cluster runs: ``--cluster-calibration``); 1: the ideal."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.global_batch < 1:
            raise ValueError(f"steps and global batch must be >= 1, got {self.steps} and {self.global_batch}")
        if (self.deadline_h is None) == (self.budget is None):
            raise ValueError("give exactly one of a deadline (hours) and a budget")
        for name in ("deadline_h", "budget"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, got {value}")
        if self.max_machines < 1 or self.max_microbatches < 1:
            raise ValueError("max_machines and max_microbatches must be >= 1")
        if not (0 < self.worker_link_efficiency <= 2 and 0 < self.node_link_efficiency <= 2):
            raise ValueError(f"link efficiencies must be in (0, 2], got {self.worker_link_efficiency} and {self.node_link_efficiency}")
        if self.replacement_s < 0 or self.morph_pause_steps < 0 or self.checkpoint_interval_s <= 0:
            raise ValueError("replacement_s and morph_pause_steps must be >= 0, checkpoint_interval_s > 0")


@dataclass(frozen=True)
class Rental:
    """Machines of one type for one role."""

    machine: MachineType
    count: int
    spot: bool

    @property
    def price_per_hour(self) -> float:
        return self.count * self.machine.price(self.spot)

    def label(self) -> str:
        return f"{self.count} x {self.machine.name}{' (spot)' if self.spot else ''}"


@dataclass
class Option:
    """One configuration the search priced."""

    workers: Rental
    nodes: Rental
    estimate: StepEstimate
    ideal_h: float  # steps x step time, no preemption
    hours: float  # expected, preemptions included
    cost: float
    lost_fraction: float  # of the time, to preemptions
    notes: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> int:
        return self.workers.count * self.workers.machine.gpu_count

    def label(self) -> str:
        c = self.estimate.candidate
        return f"workers {self.workers.label()}, nodes {self.nodes.label()}: P={c.stages} D={c.replicas} M={c.microbatches} {c.schedule}"

    def bottleneck(self) -> str:
        """What bounds the step, in words."""
        e = self.estimate
        if e.pipeline_s >= e.update_s:
            return f"compute ({e.pipeline_s:.3g} s of the pipeline, bubble {e.bubble_fraction:.0%})"
        if e.network_s >= e.node_s:
            return f"the network ({e.network_s:.3g} s each way for the update)"
        return f"the nodes' update ({e.node_s:.3g} s)"


def _counts(limit: int) -> list[int]:
    counts, n = [], 1
    while n <= limit:
        counts.append(n)
        n *= 2
    return counts


def _rentals(machines: tuple[MachineType, ...], limit: int, spot_allowed: bool) -> Iterator[Rental]:
    for machine in machines:
        for count in _counts(limit):
            yield Rental(machine, count, spot=False)
            if spot_allowed and machine.spot_price_per_hour is not None:
                yield Rental(machine, count, spot=True)


def hardware(workers: Rental, nodes: Rental, job: Job | None = None) -> Hardware:
    """How :func:`estimate_step` sees a rental: each rank a GPU of the worker type sharing its
    machine's link with the other ranks there, each node a machine of its own (links at the job's
    measured efficiencies)."""
    w, n = workers.machine, nodes.machine
    return Hardware(
        worker_link_efficiency=job.worker_link_efficiency if job else 1.0,
        node_link_efficiency=job.node_link_efficiency if job else 1.0,
        worker_speed=w.gpu_speed,
        worker_link_bytes_per_s=w.network_bytes_per_s / w.gpu_count,
        node_link_bytes_per_s=n.network_bytes_per_s,
        link_latency_s=max(w.network_latency_us, n.network_latency_us) * 1e-6,
        node_cores=float(n.cpu_cores),
    )


def lost_fraction(job: Job, workers: Rental, nodes: Rental, replicas: int, step_s: float) -> float:
    """The expected share of wall time lost to preemptions (see the module's docstring)."""
    lost_per_hour = 0.0
    if workers.spot:
        width_loss = 1.0 if replicas == 1 else 1.0 / replicas
        per_preemption = job.morph_pause_steps * step_s + width_loss * job.replacement_s
        lost_per_hour += workers.machine.spot_preemptions_per_hour * workers.count * per_preemption
    if nodes.spot:
        per_preemption = job.checkpoint_interval_s / 2 + job.replacement_s
        lost_per_hour += nodes.machine.spot_preemptions_per_hour * nodes.count * per_preemption
    return lost_per_hour / 3600.0


def price_options(profile: CostProfile, catalog: Catalog, job: Job) -> list[Option]:
    """Every configuration that fits, priced (not yet filtered by the deadline or budget)."""
    num_blocks = len(next(iter(profile.pipeline.block_costs.values())))
    options: list[Option] = []
    for workers in _rentals(catalog.workers, job.max_machines, spot_allowed=True):
        ranks = workers.count * workers.machine.gpu_count
        for nodes in _rentals(catalog.nodes, job.max_machines, spot_allowed=job.spot_nodes):
            link = hardware(workers, nodes, job)
            for candidate in candidates(ranks, job.global_batch, num_blocks, nodes.count, max_microbatches=job.max_microbatches):
                if candidate.layerwise:
                    continue
                estimate = estimate_step(profile, candidate, job.global_batch, link)
                if estimate.worker_memory_bytes > workers.machine.gpu_memory_bytes or estimate.node_memory_bytes > nodes.machine.memory_bytes:
                    continue
                lost = lost_fraction(job, workers, nodes, candidate.replicas, estimate.step_s)
                if lost >= 1.0:
                    continue
                ideal_h = job.steps * estimate.step_s / 3600.0
                hours = ideal_h / (1.0 - lost)
                cost = hours * (workers.price_per_hour + nodes.price_per_hour)
                options.append(Option(workers, nodes, estimate, ideal_h, hours, cost, lost))
    return options


def choose(options: list[Option], job: Job) -> list[Option]:
    """The options that meet the deadline, cheapest first (ties: faster), or those within the budget,
    fastest first (ties: cheaper); of each rental (the same machines) only its best configuration."""
    if job.deadline_h is not None:
        ranked = sorted((o for o in options if o.hours <= job.deadline_h), key=lambda o: (o.cost, o.hours))
    else:
        assert job.budget is not None
        ranked = sorted((o for o in options if o.cost <= job.budget), key=lambda o: (o.hours, o.cost))
    best_of_rental: dict[tuple[Rental, Rental], Option] = {}
    for option in ranked:
        best_of_rental.setdefault((option.workers, option.nodes), option)
    return list(best_of_rental.values())


def why(ranked: list[Option], options: list[Option], job: Job, currency: str) -> list[str]:
    """Why the first option wins, in sentences: what it is bounded by, and what the runner-up, the
    fastest and the cheapest of all cost or take instead."""
    best = ranked[0]
    lines = [f"bounded by {best.bottleneck()}"]
    if best.workers.spot or best.nodes.spot:
        on_demand = next(
            (
                o
                for o in options
                if o.estimate.candidate == best.estimate.candidate
                and (o.workers.machine, o.workers.count, o.nodes.machine, o.nodes.count)
                == (best.workers.machine, best.workers.count, best.nodes.machine, best.nodes.count)
                and not (o.workers.spot or o.nodes.spot)
            ),
            None,
        )
        lines.append(
            f"spot preemptions are expected to cost {best.lost_fraction:.1%} of its time"
            + (f"; on demand it would take {on_demand.hours:.3g} h for {on_demand.cost:.4g} {currency}" if on_demand else "")
        )
    if job.deadline_h is not None:
        lines.append(f"the cheapest of {len(ranked)} rentals (each with its best P x D x M) that finish within {job.deadline_h:g} h")
    else:
        lines.append(f"the fastest of {len(ranked)} rentals (each with its best P x D x M) within the budget of {job.budget:g} {currency}")
    if len(ranked) > 1:
        second = ranked[1]
        if job.deadline_h is not None:
            lines.append(f"the next ({second.label()}) costs {second.cost - best.cost:+.4g} {currency} ({second.cost / best.cost - 1:+.1%})")
        else:
            lines.append(f"the next ({second.label()}) takes {second.hours - best.hours:+.3g} h ({second.hours / best.hours - 1:+.1%})")
    fastest = min(options, key=lambda o: (o.hours, o.cost))
    cheapest = min(options, key=lambda o: (o.cost, o.hours))
    if fastest is not best:
        lines.append(f"the fastest of all ({fastest.label()}) takes {fastest.hours:.3g} h for {fastest.cost:.4g} {currency}")
    if cheapest is not best:
        lines.append(f"the cheapest of all ({cheapest.label()}) costs {cheapest.cost:.4g} {currency} and takes {cheapest.hours:.3g} h")
    return lines


def plan_cost(profile: CostProfile, catalog: Catalog, job: Job) -> tuple[list[Option], list[Option]]:
    """``(ranked, priced)``: the options meeting the job's deadline or budget, best first, and every
    option priced (what the explanation compares with)."""
    priced = price_options(profile, catalog, job)
    return choose(priced, job), priced
