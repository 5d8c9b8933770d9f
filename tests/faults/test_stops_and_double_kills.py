"""Processes frozen with SIGSTOP, and a worker killed together with the node.

- A worker, or the node, stopped with SIGSTOP for 5 s at a seeded moment (a phase, step and event of
  a worker's step) and then continued: nothing notices but the clock, the job ends bitwise. A node
  frozen for 5 s is below the workers' ``silent_after_s`` (10 s, the default, used here): no worker
  takes it for gone and reconnects.
- A worker and the node killed together with SIGKILL at a seeded moment, the node restarted on its
  address with the same flags plus ``--resume`` (checkpoints every step), the worker with the same
  command: the job ends bitwise.

The modes (full, push during backward, layer-wise) rotate with the seed."""

from __future__ import annotations

import random
import signal
import time

import pytest

from tests.faults.harness import STEPS, TRIALS, WORLD, Job, bitwise_equal, continue_after
from tests.faults.test_worker_restarts import EVENTS, PHASES

pytestmark = pytest.mark.faults

MODES = ["full", "early", "layerwise"]
STOP_S = 5.0
LOST_GRADIENTS = "which layer-wise workers do not keep: restart the worker"
LOST_INITIAL_VALUES = "restart the worker (the job starts over from its initial values)"
"""What a layer-wise survivor says when the node lost gradients it pushed (it keeps none to push again)."""
FAST_LIVENESS = ("--heartbeat", "0.5", "--silent-after", "2", "--reconnect", "30")


def moment(rng: random.Random, first_step: int = 0) -> str:
    """A seeded PHASE:STEP:N of a worker's run, at ``first_step`` or later."""
    phase = rng.choice(PHASES)
    return f"{phase}:{rng.randrange(first_step, STEPS)}:{rng.randint(1, EVENTS[phase])}"


def supervise(job: Job, timeout_s: float = 180.0) -> None:
    """Wait for every rank, restarting (same command) one that stops because the node lost what it
    cannot give again: the gradients a layer-wise worker pushed, or the initial values rank 0 was
    giving a node killed before its first checkpoint; any other exit but 0 fails."""
    restarts, deadline = 0, time.monotonic() + timeout_s
    while any(process.poll() != 0 for process in job.workers.values()):
        assert time.monotonic() < deadline, f"the workers still run after {timeout_s} s\n{job.logs()}"
        for rank, process in list(job.workers.items()):
            if process.poll() not in (0, None):
                log_text = job.worker_log(rank)
                restartable = (job.mode == "layerwise" and LOST_GRADIENTS in log_text) or LOST_INITIAL_VALUES in log_text
                assert restartable and restarts < 2 * WORLD, job.logs()
                restarts += 1
                job.start_worker(rank)
        time.sleep(0.05)


def check_bitwise(job: Job, reference, plan: str) -> None:
    difference = bitwise_equal(job.result(), reference[job.mode])
    assert difference == 0.0, f"{job.mode} {plan}: parameters differ by {difference}\n{job.logs()}"


@pytest.mark.parametrize("target", [pytest.param("worker", marks=pytest.mark.slow), pytest.param("node", marks=pytest.mark.slow)])
@pytest.mark.parametrize("seed", range(TRIALS))
def test_a_process_stopped_for_5s_and_continued_changes_nothing(tmp_path, reference, target, seed):
    """SIGSTOP for 5 s, then SIGCONT, of a worker or of the node, at a seeded moment of a worker's step."""
    rng = random.Random(f"stop-{target}-{seed}")
    job = Job(tmp_path, mode=MODES[(seed + (target == "node")) % len(MODES)])
    rank, when = rng.randrange(WORLD), moment(rng)
    try:
        node = job.start_node()
        to = "self" if target == "worker" else str(node.process.pid)
        for r in range(WORLD):
            job.start_worker(r, extra=("--signal-at", when, "--signal", "STOP", "--to", to) if r == rank else ())
        victim = job.workers[rank].pid if target == "worker" else node.process.pid
        holder = continue_after(victim, STOP_S)
        for r in range(WORLD):
            assert job.wait(r) == 0, job.logs()
        holder.join(10)
        assert holder.stopped_s >= STOP_S, f"the {target} was never stopped ({when} of rank {rank})\n{job.logs()}"
        assert "reconnecting" not in job.logs(), f"a worker took the node stopped for {STOP_S} s for gone\n{job.logs()}"
        check_bitwise(job, reference, f"{target} stopped at {when} of rank {rank}")
    finally:
        job.close()


@pytest.mark.parametrize("seed", range(TRIALS))
def test_the_node_killed_and_resumed_with_8bit_moments_continues_bitwise(tmp_path, reference, seed):
    """SIGKILL to a node keeping the moments in 8 bits, at a seeded moment of a worker's step, and
    ``--resume``: its checkpoint holds the encoded moments, and the run ends bitwise as one with no kill."""
    rng = random.Random(f"node-8bit-{seed}")
    checkpoints = tmp_path / "checkpoints"
    job = Job(tmp_path, mode="full-8bit", node_args=("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1"))
    job.worker_args = FAST_LIVENESS
    rank, when = rng.randrange(WORLD), moment(rng)
    try:
        node = job.start_node()
        for r in range(WORLD):
            job.start_worker(r, extra=("--signal-at", when, "--signal", "KILL", "--to", str(node.process.pid)) if r == rank else ())
        deadline = time.monotonic() + 120
        while node.process.poll() is None and any(job.workers[r].poll() is None for r in range(WORLD)):  # killed, or the moment never came
            assert time.monotonic() < deadline, job.logs()
            time.sleep(0.05)
        if node.process.poll() == -signal.SIGKILL:
            job.restart_node()
        supervise(job)
        check_bitwise(job, reference, f"node killed at {when} of rank {rank}")
    finally:
        job.close()


@pytest.mark.slow  # 25-40 s; worker kills (test_worker_restarts.py) and node kills (test_node_restarts.py) each stay in the default run
@pytest.mark.parametrize("seed", range(TRIALS))
def test_a_worker_and_the_node_killed_together_continue_bitwise(tmp_path, reference, seed):
    """SIGKILL to the node and to one worker at the same moment; both restarted (the node with
    ``--resume``), the other worker left running: it reconnects by itself and continues. Checkpoints
    are written before the values that end their step go out (and step 0 before training starts),
    so the node never comes back behind the workers. Only a layer-wise survivor whose pushed
    gradients the node lost stops, asking to be restarted, and is (as ``torchrun --max-restarts``
    would do; docs/faults.md)."""
    rng = random.Random(f"together-{seed}")
    checkpoints = tmp_path / "checkpoints"
    job = Job(tmp_path, mode=MODES[seed % len(MODES)], node_args=("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1"))
    job.worker_args = FAST_LIVENESS
    rank, when = rng.randrange(WORLD), moment(rng)
    try:
        node = job.start_node()
        for r in range(WORLD):
            job.start_worker(r, extra=("--signal-at", when, "--signal", "KILL", "--to", f"{node.process.pid},self") if r == rank else ())
        status = job.wait(rank)
        if status == -signal.SIGKILL:
            assert node.process.wait(10) == -signal.SIGKILL
            job.restart_node()
            job.start_worker(rank)  # the same command, less the plan that killed it
        else:  # the drawn event never came: nothing was killed
            assert status == 0, job.logs()
        supervise(job)
        check_bitwise(job, reference, f"node and rank {rank} killed at {when}")
    finally:
        job.close()
