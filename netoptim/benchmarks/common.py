"""Helpers shared by the benchmarks: timing with medians and a memory-bandwidth probe."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm


def _shown(label: str) -> dict:
    """tqdm's ``disable`` only when there is no label: given explicitly, it would override TQDM_DISABLE
    (what ``netoptim --no-progress`` sets)."""
    return {} if label else {"disable": True}


def median_seconds(run: Callable[[], None], repeats: int, *, setup: Callable[[], None] | None = None, label: str = "") -> float:
    """Median wall time of ``run`` over ``repeats`` timed calls after one warm-up; ``setup`` runs untimed before each."""
    if setup:
        setup()
    run()  # warm-up: page faults, allocator, thread pool
    times = []
    for _ in tqdm(range(repeats), desc=label, leave=False, **_shown(label)):
        if setup:
            setup()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def interleaved_seconds(runs: dict[str, Callable[[], float | None]], repeats: int, *, label: str = "") -> dict[str, list[float]]:
    """Wall times of each of ``runs`` over ``repeats`` rounds, in turns: each round calls each run
    twice in a row and times the second call.

    Taking turns makes the i-th times of two runs comparable on a shared machine, where the load of
    other work drifts over a measurement: compare them round by round (:func:`median_ratio`). The
    untimed first call absorbs what the other run leaves behind: caches, and the threads of its
    thread pool still spinning for work (torch's and numba's OpenMP runtimes are distinct), so each
    run is timed in its steady state. A run that returns a number has timed itself (the part of
    its work it stands for, leaving out what it stages for it) and that number is its time."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in tqdm(range(repeats), desc=label, leave=False, **_shown(label)):
        for name, run in runs.items():
            run()
            started = time.perf_counter()
            own = run()
            times[name].append(time.perf_counter() - started if own is None else own)
    return times


def bucket_sizes(numel: int, bucket_numel: int) -> list[int]:
    """The buckets of ``numel`` parameters in ``bucket_numel``-element buckets: the whole ones, then the rest."""
    whole, rest = divmod(numel, bucket_numel)
    return [bucket_numel] * whole + ([rest] if rest else [])


def median_ratio(baseline: list[float], measured: list[float]) -> float:
    """Median over rounds of ``baseline / measured`` time: how many times faster ``measured`` ran."""
    return statistics.median(base / seconds for base, seconds in zip(baseline, measured, strict=True))


def memory_bandwidth_gbs(repeats: int, nbytes: int = 256 << 20) -> float:
    """GB/s of an in-place add over large tensors (two reads, one write per element).

    In place on purpose: the node's kernels update in place, and a write to a fresh buffer costs an
    extra read for ownership that would understate the bandwidth they see."""
    target = torch.ones(nbytes // 4)
    source = torch.ones(nbytes // 4)
    seconds = median_seconds(lambda: target.add_(source), repeats)
    return 3 * nbytes / seconds / 1e9


def vm_bytes(field: str, pid: int | str = "self") -> int:
    """A memory field of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``: the peak resident size so far), in
    bytes; 0 where the system has no such file or field."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def node_flag(node_args: Sequence[str], flag: str) -> str | None:
    """The value the local nodes' flags (``--node-arg``) give ``flag`` (``--flag=V`` or ``--flag V``; the
    last one wins, as in the node's parser), ``""`` for a flag without a value, ``None`` if absent."""
    value = None
    for index, arg in enumerate(node_args):
        if arg == flag:
            following = node_args[index + 1] if index + 1 < len(node_args) else ""
            value = "" if following.startswith("--") else following
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def store_io_threads(node_args: Sequence[str]) -> int:
    """The state-file readers and writers of a local node given ``node_args``: ``--state-io-threads``
    (default 2) each way with ``--state-dir``, none in memory (:attr:`NodeConfig.store_io_threads`)."""
    if node_flag(node_args, "--state-dir") is None:
        return 0
    threads = node_flag(node_args, "--state-io-threads")
    try:
        return 2 * int(threads) if threads else 4
    except ValueError:
        raise ValueError(f"--node-arg=--state-io-threads={threads}: not a whole number") from None


def check_node_args(node_args: Sequence[str], nodes: int, *, own_directories: str = "") -> None:
    """``ValueError`` for a ``--state-dir`` among the flags given to every local node (``--node-arg``)
    where more than one node, or a benchmark flag that gives each node a directory of its own
    (``own_directories``, named in the message), would take it: a node clears the state files it
    finds at start, so nodes sharing one directory would clear each other's."""
    if not any(arg == "--state-dir" or arg.startswith("--state-dir=") for arg in node_args):
        return
    if own_directories:
        raise ValueError(f"--node-arg=--state-dir: use {own_directories}, which gives each local node a state directory of its own")
    if nodes > 1:
        raise ValueError(
            f"--node-arg=--state-dir would give all {nodes} local nodes one state directory, where each clears the state files it finds at start; use --nodes 1"
        )
