"""A worker killed with SIGKILL at a random moment and started again (the same command, as torchrun
would) continues the job exactly: the final parameters are bitwise those of an uninterrupted run.

Each trial draws, from its seed, the phase (forward, backward, push, pull), the step and the event
within it; ``NETOPTIM_FAULT_TRIALS`` sets the number of trials per case (a few in CI)."""

from __future__ import annotations

import random
import signal
import time

import pytest

from tests.faults.harness import STEPS, TRIALS, WORLD, Job, bitwise_equal

pytestmark = pytest.mark.faults

PHASES = ["forward", "backward", "push", "pull"]
EVENTS = {"forward": 4, "backward": 40, "push": 8, "pull": 8}  # events of a phase in one step (at most)


def death(rng: random.Random) -> str:
    phase = rng.choice(PHASES)
    return f"{phase}:{rng.randrange(STEPS)}:{rng.randint(1, EVENTS[phase])}"


def run_trial(job: Job, deaths: dict[int, str], timeout_s: float = 120.0) -> None:
    """Start every rank (those in ``deaths`` die as planned), restart each dead one as soon as it
    dies, as a supervisor (torchrun, Kubernetes) would, and wait for all. A rank whose planned death
    comes at a later step than another's only gets there once that other one is back."""
    job.start_node()
    for rank in range(WORLD):
        job.start_worker(rank, deaths.get(rank))
    pending = set(deaths)
    deadline = time.monotonic() + timeout_s
    while pending:
        for rank in sorted(pending):
            status = job.workers[rank].poll()
            if status is None:
                continue
            pending.discard(rank)
            if status == -signal.SIGKILL:
                job.start_worker(rank)  # the same command again
            else:  # the planned event never came (e.g. fewer pushes than drawn): it just finished
                assert status == 0, job.logs()
        assert time.monotonic() < deadline, f"ranks {sorted(pending)} neither died as planned nor finished within {timeout_s} s:\n{job.logs()}"
        time.sleep(0.05)
    for rank in range(WORLD):
        assert job.wait(rank) == 0, job.logs()


def assert_continues_bitwise(tmp_path, reference: dict, mode: str, deaths: dict[int, str]) -> None:
    job = Job(tmp_path, mode=mode)
    try:
        run_trial(job, deaths)
        difference = bitwise_equal(job.result(), reference[mode])
        assert difference == 0.0, f"{deaths}: parameters differ by {difference}\n{job.logs()}"
    finally:
        job.close()


@pytest.mark.parametrize(
    "mode",
    [
        "full",
        "full-8bit",  # moments kept in 8 bits on the node: a restarted worker's step is summed and rounded as before
        "overlapped",  # the new values awaited in the next forward: a death there, and a restart that comes back mid-forward
        pytest.param("early", marks=pytest.mark.slow),
        pytest.param("paced", marks=pytest.mark.slow),
        pytest.param("layerwise", marks=pytest.mark.slow),
        pytest.param("layerwise-kept", marks=pytest.mark.slow),  # backward fetches nothing: a restart mid-backward fetches again
    ],
)
@pytest.mark.parametrize("seed", range(TRIALS))
def test_one_worker_killed_and_restarted_continues_bitwise(tmp_path, reference, mode, seed):
    rng = random.Random(f"{mode}-{seed}")
    assert_continues_bitwise(tmp_path, reference, mode, {rng.randrange(WORLD): death(rng)})


@pytest.mark.parametrize("mode", [pytest.param("full", marks=pytest.mark.slow), pytest.param("layerwise", marks=pytest.mark.slow)])
@pytest.mark.parametrize("seed", range(max(1, TRIALS // 2)))
def test_both_workers_killed_and_restarted_continue_bitwise(tmp_path, reference, mode, seed):
    rng = random.Random(f"both-{mode}-{seed}")
    assert_continues_bitwise(tmp_path, reference, mode, {rank: death(rng) for rank in range(WORLD)})


def test_the_overlapped_forward_ends_bitwise_where_the_full_model_ends(reference):
    """The reference runs themselves: overlapping the next forward changes when values are installed, not what they are."""
    assert bitwise_equal(reference["overlapped"], reference["full"]) == 0.0


@pytest.mark.slow
def test_units_kept_for_backward_end_bitwise_where_the_full_model_ends(reference):
    """The reference runs themselves: keeping units from forward to backward changes what is fetched, not the values."""
    assert bitwise_equal(reference["layerwise-kept"], reference["full"]) == 0.0
