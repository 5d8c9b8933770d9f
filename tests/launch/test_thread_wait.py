"""What a node's update threads do between passes (``--update-threads-wait``): the choice, and the
real OpenMP runtime sleeping or spinning after a pass in a fresh interpreter, and a real node
picking it before it imports torch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from netoptim.launch.thread_wait import apply_update_thread_wait, resolve_update_thread_wait

IDLE_CPU_PROBE = """
import sys, time
from netoptim.launch.thread_wait import apply_update_thread_wait
applied = apply_update_thread_wait(sys.argv[1]) if sys.argv[2] == "before" else None
import torch
if sys.argv[2] == "after":
    applied = apply_update_thread_wait(sys.argv[1])
import numba, numpy as np

@numba.njit(parallel=True)
def add_one(a):
    for i in numba.prange(a.size):
        a[i] += 1.0

values = np.zeros(1 << 22)
add_one(values)
idle = 0.0
for _ in range(5):  # a pass, then 50 ms with nothing to do: what the process's threads burn meanwhile
    add_one(values)
    start = time.process_time()
    time.sleep(0.05)
    idle += time.process_time() - start
print(applied, round(idle * 1000, 2))
"""


@pytest.mark.parametrize(
    ("choice", "own_cpus", "environ", "wait"),
    [
        ("auto", True, {}, "spin"),
        ("auto", False, {}, "sleep"),
        ("auto", True, {"OMP_WAIT_POLICY": "passive"}, "sleep"),
        ("auto", False, {"OMP_WAIT_POLICY": "ACTIVE"}, "spin"),
        ("auto", False, {"OMP_WAIT_POLICY": "bogus"}, "sleep"),
        ("spin", False, {"OMP_WAIT_POLICY": "PASSIVE"}, "spin"),
        ("sleep", True, {}, "sleep"),
    ],
)
def test_auto_spins_on_cpus_of_its_own_and_sleeps_on_shared_ones_unless_the_environment_says(choice, own_cpus, environ, wait):
    assert resolve_update_thread_wait(choice, own_cpus=own_cpus, environ=environ) == wait


def test_unknown_choices_are_refused():
    with pytest.raises(ValueError, match="auto, sleep, spin"):
        resolve_update_thread_wait("nap", own_cpus=False, environ={})
    with pytest.raises(ValueError, match="'sleep' or 'spin'"):
        apply_update_thread_wait("auto")


def idle_cpu_ms(wait: str, when: str) -> tuple[str, float]:
    environment = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"} | {"NUMBA_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", IDLE_CPU_PROBE, wait, when], capture_output=True, text=True, timeout=120, env=environment, check=True)
    applied, milliseconds = done.stdout.split()
    return applied, float(milliseconds)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs: OpenMP does not spin threads it has more of than CPUs")
def test_sleeping_update_threads_leave_the_cpus_idle_between_passes_and_spinning_ones_do_not():
    applied, sleeping = idle_cpu_ms("sleep", "before")
    assert applied == "True" and sleeping < 5.0, sleeping
    applied, spinning = idle_cpu_ms("spin", "before")
    assert applied == "True" and spinning > 10.0 and spinning > 4 * sleeping, (spinning, sleeping)
    applied, late = idle_cpu_ms("sleep", "after")  # torch loaded OpenMP first: it read the policy then
    assert applied == "False" and late > 10.0, late


@pytest.mark.fresh_nodes
def test_a_node_sleeps_on_shared_cpus_and_spins_on_its_own(start_node, tmp_path):
    shared = start_node(name="shared")
    pinned = start_node(name="pinned", extra_args=("--cpus", str(min(os.sched_getaffinity(0)))))
    chosen = start_node(name="chosen", extra_args=("--update-threads-wait", "spin"))
    out_of_core = start_node(
        name="ooc", extra_args=("--cpus", str(min(os.sched_getaffinity(0))), "--state-dir", str(tmp_path / "state"), "--memory-budget", "64MiB")
    )
    for node, wait in ((shared, "sleep"), (pinned, "spin"), (chosen, "spin"), (out_of_core, "sleep")):
        log = node.log_text()
        assert f"update threads between passes: {wait};" in log and "loaded OpenMP before" not in log, log[-2000:]
        said = ("huge pages: on (--huge-pages", "huge pages: asked for (--huge-pages) but not granted", "in the environment says")
        assert any(words in log for words in said), log[-2000:]
