"""A node's CPU priority where it shares cores with workers (``netoptim node --nice``).

A node's update of a bucket starts when the last rank's gradient of it arrives, on the core of the
worker that sent it: the scheduler puts a woken process where its waker runs, and a node of the same
priority takes the core from it at once. On a host whose cores run CPU workers, the node's work then
lands on whichever worker is behind, which falls further behind; at the end of backward the other
waits for it. With two workers and a node on 2 cores (``bench train --sizes base``, layer-wise) the
worker that finished backward first waited a median 110-120 ms a step for the other; at niceness 10
the node's work spreads over both and that wait was 13-15 ms, 5-6% more tokens/s. A node on cores of
its own (``--cpus``, or a host of its own) gains nothing from it and needs none.
"""

from __future__ import annotations

import os

NICE_RANGE = range(-20, 20)
SHARED_CORES_NICENESS = 10
"""What ``netoptim demo`` and ``bench train`` give their local nodes, which share the workers' cores."""


def check_niceness(niceness: int) -> int:
    """``niceness`` if it is one (-20..19), else ``ValueError`` saying the range."""
    if niceness not in NICE_RANGE:
        raise ValueError(f"a niceness goes from -20 (most CPU) to 19 (least), not {niceness}")
    return niceness


def apply_niceness(niceness: int) -> None:
    """Give every thread of this process the CPU niceness ``niceness`` (Linux's is per thread: the
    threads started later inherit it). ``ValueError`` outside -20..19; ``PermissionError``, saying
    so, for a niceness below the current one without the right to raise priority."""
    check_niceness(niceness)
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread, as POSIX has it for the whole process
        threads = [0]
    try:
        for tid in threads:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except PermissionError:
        current = os.getpriority(os.PRIO_PROCESS, 0)
        raise PermissionError(
            f"cannot set niceness {niceness} (now {current}): a niceness below the current one needs root or CAP_SYS_NICE; give {current} or more"
        ) from None
