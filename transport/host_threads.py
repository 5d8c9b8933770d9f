"""Threads as the operating system sees them: named after their Python names, and their CPU time.

Python (3.11) does not give its threads an OS name: every thread of a node shows as the process in
``top -H`` and ``/proc/PID/task/*/comm``, so a node's CPU could not be told apart by thread (the
serve loop, the state reads and writes, ZeroMQ's I/O thread, the update threads). The node's own
threads call :func:`name_os_thread` as they start; :func:`thread_cpu_seconds` sums a process's CPU
time by those names (the benchmarks report it per step). Linux only; elsewhere naming does nothing
and the sums are empty.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import threading
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

_PR_SET_NAME = 15
_OS_NAME_BYTES = 15  # the kernel keeps 16 bytes, the last a NUL
MAIN_THREAD = "main"
"""What :func:`thread_cpu_seconds` calls a process's first thread (a node's serve loop)."""
_NUMBERED = re.compile(r"[_/-]\d*$")  # a pool's number, or what the kernel's cut left of it ("netoptim-write_"); not "python3.11"


@cache
def _prctl():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread an OS name: ``name``, or its Python name (its first 15 bytes). Usable as
    a ``ThreadPoolExecutor`` initializer. Never fails: a name is a diagnostic."""
    prctl = _prctl()
    if prctl is None:
        return
    encoded = (name or threading.current_thread().name).encode(errors="replace")[:_OS_NAME_BYTES]
    if prctl(_PR_SET_NAME, ctypes.c_char_p(encoded), 0, 0, 0) != 0:
        log.debug("cannot name thread %r: errno %d", encoded, ctypes.get_errno())


def thread_group(name: str) -> str:
    """The group an OS thread name counts in: numbered threads of a pool together (``netoptim-read_0``
    and ``netoptim-read_1`` as ``netoptim-read``, ``ZMQbg/IO/0`` as ``ZMQbg/IO``)."""
    return _NUMBERED.sub("", name) or name


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds each group of process ``pid``'s live threads used so far, by
    :func:`thread_group` of their OS names; its first thread as :data:`MAIN_THREAD`. Threads that
    kept the process's name (torch's and numba's compute threads, unnamed helpers) count under that
    name. A thread that ended is no longer counted: compare groups whose threads live on."""
    groups: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            seconds = _task_cpu_seconds(task)
            name = MAIN_THREAD if task.name == str(pid) else thread_group((task / "comm").read_text().strip())
        except OSError:  # ended meanwhile
            continue
        groups[name] = groups.get(name, 0.0) + seconds
    return groups


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system, in 10 ms ticks) process ``pid`` used so far, all its threads,
    ended ones too."""
    return _ticks_seconds(Path(f"/proc/{pid}/stat"))


def _task_cpu_seconds(task: Path) -> float:
    """CPU seconds of one thread (``/proc/PID/task/TID``): its ``schedstat`` (nanoseconds on a CPU)
    where the kernel keeps one, else its ticks (a thread that ran less than one in a short step would
    show none)."""
    try:
        return int((task / "schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return _ticks_seconds(task / "stat")


def _ticks_seconds(stat: Path) -> float:
    """utime + stime of a ``/proc`` stat file, in seconds."""
    fields = stat.read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds_between(before: dict[str, float], after: dict[str, float], per: float = 1.0) -> dict[str, float]:
    """Each group's CPU seconds from ``before`` to ``after`` (:func:`thread_cpu_seconds`), divided by
    ``per`` (steps), to 0.1 ms, largest first; groups that used less left out."""
    spent = {name: round((seconds - before.get(name, 0.0)) / per, 4) for name, seconds in after.items()}
    return {name: seconds for name, seconds in sorted(spent.items(), key=lambda item: -item[1]) if seconds > 0}
