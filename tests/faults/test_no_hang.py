"""No hang anywhere: a process killed with SIGKILL and *not* restarted stops every worker that
survives it, within its deadline, with an error that names what is missing.

Each process kind (worker rank 0, worker rank 1, the node) is killed at each phase of a worker's step
(forward, backward, push, pull; a seeded step and event, never in the last step, so the survivors
always need the dead one again). The four phases of a kind run as four jobs at once (the survivors
mostly wait, and the drill's time is the deadlines'). By default rank 0 dies in backward; its
other phases and the other two kinds are marked ``slow``. The workers get short deadlines:

- a dead worker: the other rank waits ``timeout_s`` without progress and fails with the node's
  account, ``node tcp://...: waiting for gradients from rank(s) [k]``; the node stays up (a daemon);
- a dead node: both workers fail ``silent_after_s + reconnect_s`` after it stopped answering, with
  ``node tcp://... stopped answering ... did not come back`` (or, for a rank still registering,
  ``node tcp://... did not answer within``, after its first-answer deadline).
"""

from __future__ import annotations

import random
import time

import pytest

from tests.faults.harness import STEPS, TRIALS, WORLD, Job
from tests.faults.test_worker_restarts import PHASES

pytestmark = pytest.mark.faults

TIMEOUT_S, HEARTBEAT_S, SILENT_AFTER_S, RECONNECT_S = 8.0, 0.5, 2.0, 4.0
DEADLINES = ("--heartbeat", str(HEARTBEAT_S), "--silent-after", str(SILENT_AFTER_S), "--reconnect", str(RECONNECT_S))
SLACK_S = 8.0
"""For the error's diagnosis (it asks the nodes, up to 5 s) and the process's exit, on a busy machine."""
FIRST = {"forward": 4, "backward": 20, "push": 6, "pull": 6}  # events every step of a full-mode worker has


def deadline_s(kind: str) -> float:
    return (SILENT_AFTER_S + RECONNECT_S if kind == "node" else TIMEOUT_S) + HEARTBEAT_S + SLACK_S


def start(job: Job, kind: str, when: str) -> None:
    """The node and both ranks; the victim dies at ``when`` (a node by rank 0's hand)."""
    node = job.start_node()
    for rank in range(WORLD):
        extra = ()
        if kind == f"rank{rank}":
            extra = ("--signal-at", when, "--signal", "KILL", "--to", "self")
        elif kind == "node" and rank == 0:
            extra = ("--signal-at", when, "--signal", "KILL", "--to", str(node.process.pid))
        job.start_worker(rank, extra=extra)


def watch(jobs: dict[str, Job], kind: str, give_up_s: float) -> dict[str, tuple[float, dict[int, float]]]:
    """Per phase: when the victim died, and when each survivor exited (monotonic seconds)."""
    died: dict[str, float] = {}
    exited: dict[str, dict[int, float]] = {phase: {} for phase in jobs}
    stop_at = time.monotonic() + give_up_s
    while time.monotonic() < stop_at:
        now = time.monotonic()
        for phase, job in jobs.items():
            victim = job.node.process if kind == "node" else job.workers[int(kind[-1])]
            if phase not in died and victim.poll() is not None:
                died[phase] = now
            for rank, process in job.workers.items():
                if kind != f"rank{rank}" and rank not in exited[phase] and process.poll() is not None:
                    exited[phase][rank] = now
        if len(died) == len(jobs) and all(len(ranks) == WORLD - (kind != "node") for ranks in exited.values()):
            break
        time.sleep(0.02)
    return {phase: (died.get(phase, float("nan")), exited[phase]) for phase in jobs}


KILLS = [
    pytest.param("rank0", ("backward",), id="rank0-backward"),
    pytest.param("rank0", ("pull",), id="rank0-pull", marks=pytest.mark.slow),
    pytest.param("rank0", ("forward", "push"), id="rank0-forward-push", marks=pytest.mark.slow),
    pytest.param("rank1", tuple(PHASES), id="rank1", marks=pytest.mark.slow),
    pytest.param("node", tuple(PHASES), id="node", marks=pytest.mark.slow),
]
"""Who dies, at which phases (one job each, at once); by default rank 0 in backward."""


@pytest.mark.parametrize(("kind", "phases"), KILLS)
@pytest.mark.parametrize("seed", range(TRIALS))
def test_a_process_killed_and_not_restarted_stops_every_survivor_in_time(tmp_path, kind, phases, seed):
    """SIGKILL to ``kind`` at each of ``phases``; every surviving worker exits non-zero within its
    deadline, naming the node's address and, for a dead worker, its rank."""
    rng = random.Random(f"no-hang-{kind}-{seed}")
    plans = {phase: f"{phase}:{rng.randrange(STEPS - 1)}:{rng.randint(1, FIRST[phase])}" for phase in PHASES}
    plans = {phase: plans[phase] for phase in phases}  # drawn for every phase: a phase's moment is the same in any selection
    jobs = {phase: Job(tmp_path / phase, worker_timeout_s=TIMEOUT_S, worker_args=DEADLINES) for phase in phases}
    try:
        for phase, job in jobs.items():
            job.workdir.mkdir()
            start(job, kind, plans[phase])
        outcome = watch(jobs, kind, give_up_s=120.0)
        for phase, job in jobs.items():
            died, exited = outcome[phase]
            address = job.node.address
            assert died == died, f"{kind} was never killed at {plans[phase]}\n{job.logs()}"
            for rank in range(WORLD):
                if kind == f"rank{rank}":
                    continue
                assert rank in exited, f"rank {rank} still runs 120 s after {kind} died at {plans[phase]}\n{job.logs()}"
                took = exited[rank] - died
                assert took <= deadline_s(kind), f"rank {rank} took {took:.1f} s (> {deadline_s(kind)} s) to stop after {kind} died at {plans[phase]}"
                assert job.workers[rank].returncode not in (0, None), f"rank {rank} exited 0 after {kind} died at {plans[phase]}\n{job.logs()}"
                text = job.worker_log(rank)
                if kind == "node":
                    # a rank still saying HELLO when the node died is told so by the first-answer deadline
                    assert f"node {address} stopped answering" in text or f"node {address} did not answer within" in text, text[-3000:]
                else:
                    assert f"node {address}: waiting for gradients from rank(s) [{kind[-1]}]" in text, text[-3000:]
            if kind != "node":
                assert job.node.process.poll() is None, f"the node died with the worker\n{job.logs()}"
                assert job.node.stop() == 0, job.logs()
    finally:
        for job in jobs.values():
            job.close()
