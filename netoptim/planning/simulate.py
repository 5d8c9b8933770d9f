"""Step time of a pipeline schedule by discrete-event simulation.

Every rank runs its schedule's actions in order; a forward of micro-batch ``m`` at stage ``s`` waits
for stage ``s-1``'s forward of ``m`` plus the activation transfer, a backward for stage ``s+1``'s
backward plus the gradient transfer. Compute shares the machine's cores: with ``n`` actions running
on ``c`` cores each progresses at ``min(1, c / n)`` of its calibrated speed (processor sharing, which
is how ranks and optimizer nodes on one host slow each other down; on one GPU per rank use a core
count of at least the number of ranks). After the pipeline drains, every pipeline position's node
group applies the update (also sharing the cores), and the step ends when the last one is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class Action:
    kind: str  # FORWARD or BACKWARD
    microbatch: int
    stage: int


def schedule_order(schedule: str, position: int, num_positions: int, num_microbatches: int, stages_per_rank: int = 1) -> list[Action]:
    """The actions of one rank, in the order its schedule runs them (as torch's schedules do)."""
    P, M, V = num_positions, num_microbatches, stages_per_rank
    if schedule == "gpipe":
        return [Action(FORWARD, m, position) for m in range(M)] + [Action(BACKWARD, m, position) for m in range(M)]
    if schedule == "1f1b":
        warmup = min(M, P - position - 1)
        order = [Action(FORWARD, m, position) for m in range(warmup)]
        for i in range(M - warmup):
            order += [Action(FORWARD, warmup + i, position), Action(BACKWARD, i, position)]
        return order + [Action(BACKWARD, m, position) for m in range(M - warmup, M)]
    if schedule == "interleaved":
        total = M * V

        def forward(i: int) -> Action:
            chunk, group = (i // P) % V, i // (P * V)
            return Action(FORWARD, group * P + i % P, position + P * chunk)

        def backward(i: int) -> Action:
            chunk, group = V - 1 - (i // P) % V, i // (P * V)
            return Action(BACKWARD, group * P + i % P, position + P * chunk)

        warmup = min(total, (V - 1) * P + 2 * (P - 1 - position))
        order = [forward(i) for i in range(warmup)]
        for i in range(total - warmup):
            order += [forward(warmup + i), backward(i)]
        return order + [backward(i) for i in range(total - warmup, total)]
    raise ValueError(f"unknown schedule {schedule!r}")


@dataclass(frozen=True)
class StageCosts:
    """One stage at one micro-batch size: seconds of forward and backward on one core, bytes it sends on."""

    forward_s: float
    backward_s: float
    output_bytes: int


@dataclass(frozen=True)
class Simulation:
    step_s: float
    pipeline_s: float
    optimizer_s: float
    busy_s: tuple[float, ...]  # per rank, time inside its actions (slowed down where cores are shared)

    @property
    def bubble_fraction(self) -> float:
        """Mean share of the pipeline time a rank is not inside an action (what the runtime measures)."""
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.pipeline_s) if self.pipeline_s > 0 else 0.0


def simulate(
    *,
    schedule: str,
    stages: Sequence[StageCosts],
    num_positions: int,
    num_replicas: int,
    num_microbatches: int,
    stages_per_rank: int,
    cores: float,
    link_latency_s: float,
    link_bytes_per_s: float,
    action_overhead_s: float,
    optimizer_work_s: Sequence[tuple[float, float]],
    compute_scale: float = 1.0,
) -> Simulation:
    """Simulate one step. An action costs its calibrated compute times ``compute_scale`` (the same
    kernels run slower inside a job than alone) plus ``action_overhead_s`` (the runtime's own work).
    ``optimizer_work_s`` holds one ``(wall_s, cpu_s)`` per node group update (wall time alone on the
    machine, CPU seconds it spends); they run at once after the pipeline."""
    P, D, M = num_positions, num_replicas, num_microbatches
    if cores <= 0 or link_bytes_per_s <= 0 or num_microbatches < 1:
        raise ValueError(f"cores ({cores}), link bandwidth ({link_bytes_per_s}) and micro-batches ({num_microbatches}) must be positive")
    if len(stages) != P * stages_per_rank:
        raise ValueError(f"{len(stages)} stage costs for {P} positions x {stages_per_rank} stages per rank")
    orders = [schedule_order(schedule, p, P, M, stages_per_rank) for _ in range(D) for p in range(P)]
    replica_of = [r // P for r in range(P * D)]
    last_stage = len(stages) - 1
    done: dict[tuple[int, Action], float] = {}  # (replica, action) -> finish time
    next_index = [0] * len(orders)
    remaining: dict[int, float] = {}  # rank -> work left of the action it runs
    running_action: dict[int, Action] = {}
    busy = [0.0] * len(orders)
    now = 0.0

    def transfer(nbytes: int) -> float:
        return link_latency_s + nbytes / link_bytes_per_s

    def ready_at(rank: int, action: Action) -> float | None:
        replica = replica_of[rank]
        deps = []
        if action.kind == FORWARD and action.stage > 0:
            deps.append((Action(FORWARD, action.microbatch, action.stage - 1), transfer(stages[action.stage - 1].output_bytes)))
        if action.kind == BACKWARD:
            deps.append((Action(FORWARD, action.microbatch, action.stage), 0.0))
            if action.stage < last_stage:
                deps.append((Action(BACKWARD, action.microbatch, action.stage + 1), transfer(stages[action.stage].output_bytes)))
        latest = 0.0
        for dep, delay in deps:
            finished = done.get((replica, dep))
            if finished is None:
                return None
            latest = max(latest, finished + delay)
        return latest

    while any(i < len(o) for i, o in zip(next_index, orders, strict=True)) or remaining:
        for rank, order in enumerate(orders):  # start what can start now
            if rank in remaining or next_index[rank] >= len(order):
                continue
            action = order[next_index[rank]]
            at = ready_at(rank, action)
            if at is not None and at <= now + 1e-12:
                cost = stages[action.stage]
                work = (cost.forward_s if action.kind == FORWARD else cost.backward_s) * compute_scale + action_overhead_s
                remaining[rank], running_action[rank] = work, action
                next_index[rank] += 1
        pending = [
            at
            for rank, order in enumerate(orders)
            if rank not in remaining and next_index[rank] < len(order) and (at := ready_at(rank, order[next_index[rank]])) is not None
        ]
        if not remaining:
            if not pending:
                raise RuntimeError(f"the {schedule} schedule deadlocks in simulation (P={P}, M={M}, V={stages_per_rank})")
            now = max(now, min(pending))
            continue
        rate = min(1.0, cores / len(remaining))
        finish_in = min(remaining.values()) / rate
        future = [at - now for at in pending if at > now]
        step = min([finish_in, *future])
        now += step
        for rank in list(remaining):
            busy[rank] += step
            remaining[rank] -= step * rate
            if remaining[rank] <= 1e-12:
                done[(replica_of[rank], running_action.pop(rank))] = now
                del remaining[rank]
    pipeline_s = now
    # The updates of all node groups at once: as long as the slowest alone, or as long as the
    # cores take to supply the CPU time of all of them, whichever is longer.
    elapsed = max([0.0] + [wall for wall, _ in optimizer_work_s] + [sum(cpu for _, cpu in optimizer_work_s) / cores])
    return Simulation(pipeline_s + elapsed, pipeline_s, elapsed, tuple(busy))
