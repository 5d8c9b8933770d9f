"""A node's CPU niceness (``netoptim node --nice``): every thread of a real node has it, the ones it
starts after the flag was read too, and values outside -20..19 are refused before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from netoptim.launch.niceness import apply_niceness


def thread_niceness(pid: int) -> dict[int, int]:
    """Each thread of ``pid`` and its niceness (field 19 of its stat line)."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as stat:
            found[int(tid)] = int(stat.read().rsplit(")", 1)[1].split()[16])
    return found


def test_every_thread_of_a_node_has_its_niceness(start_node):
    niced = start_node(name="niced", extra_args=("--nice", "7"))
    plain = start_node(name="plain")
    assert niced.process is not None and plain.process is not None
    threads = thread_niceness(niced.process.pid)
    assert len(threads) > 1, "the node runs its ZeroMQ and admin threads by now"
    assert set(threads.values()) == {7}, threads
    assert set(thread_niceness(plain.process.pid).values()) == {os.getpriority(os.PRIO_PROCESS, 0)}
    assert "niceness: 7;" in niced.log_text()


@pytest.mark.parametrize("niceness", ["20", "-21"])
def test_a_niceness_out_of_range_is_refused_before_the_node_starts(niceness):
    done = subprocess.run(
        [sys.executable, "-m", "netoptim", "node", "--listen", "tcp://127.0.0.1:0", f"--nice={niceness}"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "a niceness goes from -20 (most CPU) to 19 (least)" in done.stderr


def test_apply_niceness_refuses_out_of_range_values_itself():
    with pytest.raises(ValueError, match="from -20"):
        apply_niceness(19 + 1)
