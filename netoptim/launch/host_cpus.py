"""Which CPUs of this host a process runs on: CPU lists as Linux spells them, the host's NUMA nodes,
disjoint CPU sets for several processes, and pinning a process to one.

A node's update pass streams its whole shard through memory each step: on a host with several NUMA
nodes it runs at the speed of the memory it touches, so a node pinned to one NUMA node's CPUs keeps
its state there (Linux places a page on the NUMA node of the CPU that first writes it, and a pinned
node allocates and first writes its state on its own CPUs). Several nodes on one host, or a node
beside a GPU worker, get disjoint sets so that their threads do not take turns on the same cores.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

NUMA_SYSFS = Path("/sys/devices/system/node")


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0-3,8,10-11"`` (the kernel's cpulist spelling) as sorted CPU numbers; ValueError if malformed."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        low, dash, high = part.partition("-")
        try:
            first, last = int(low), int(high) if dash else int(low)
        except ValueError:
            raise ValueError(f"{text!r} is not a CPU list like 0-3,8,10-11") from None
        if first < 0 or last < first:
            raise ValueError(f"{text!r}: {part!r} is not a CPU range (low-high, low <= high, from 0)")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"{text!r} names no CPU")
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """CPU numbers in the kernel's cpulist spelling: ``(0, 1, 2, 3, 8)`` -> ``"0-3,8"``."""
    ordered = sorted(set(cpus))
    ranges: list[str] = []
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            low, high = ordered[start], ordered[i - 1]
            ranges.append(str(low) if low == high else f"{low}-{high}")
            start = i
    return ",".join(ranges)


def usable_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity: a container's or ``taskset``'s limit included)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def numa_nodes(sysfs: Path = NUMA_SYSFS, usable: Sequence[int] | None = None) -> dict[int, tuple[int, ...]]:
    """This host's NUMA nodes that have usable CPUs, each with those CPUs; empty where the kernel does
    not say (no sysfs: one node, as far as placement goes)."""
    allowed = set(usable_cpus() if usable is None else usable)
    nodes: dict[int, tuple[int, ...]] = {}
    try:
        entries = sorted(sysfs.glob("node[0-9]*"), key=lambda path: int(path.name[4:]))
    except OSError:
        return {}
    for entry in entries:
        try:
            cpus = parse_cpu_list(entry.joinpath("cpulist").read_text())
        except (OSError, ValueError):  # a memory-only node has an empty list
            continue
        mine = tuple(cpu for cpu in cpus if cpu in allowed)
        if mine:
            nodes[int(entry.name[4:])] = mine
    return nodes


def split_cpus(cpus: Sequence[int], parts: int, nodes: dict[int, tuple[int, ...]] | None = None) -> list[tuple[int, ...]]:
    """``cpus`` in ``parts`` disjoint sets of near-equal size that do not straddle a NUMA node where the
    count allows it (``parts`` a multiple of the nodes': each node's CPUs split alike; otherwise
    consecutive runs of the CPUs ordered node by node). ValueError if there are fewer CPUs than parts."""
    if parts < 1:
        raise ValueError(f"parts must be positive, not {parts}")
    if len(cpus) < parts:
        raise ValueError(f"{parts} CPU sets need at least {parts} CPUs; {format_cpu_list(cpus)} has {len(cpus)}")
    chosen = set(cpus)
    by_node = [tuple(cpu for cpu in node_cpus if cpu in chosen) for _, node_cpus in sorted((nodes or {}).items())]
    by_node = [node_cpus for node_cpus in by_node if node_cpus]
    covered = {cpu for node_cpus in by_node for cpu in node_cpus}
    if len(by_node) > 1 and covered == chosen and parts % len(by_node) == 0 and all(len(n) >= parts // len(by_node) for n in by_node):
        return [piece for node_cpus in by_node for piece in _runs(node_cpus, parts // len(by_node))]
    ordered = [cpu for node_cpus in by_node for cpu in node_cpus] + sorted(chosen - covered)
    return _runs(ordered, parts)


def _runs(cpus: Sequence[int], parts: int) -> list[tuple[int, ...]]:
    """``cpus`` cut into ``parts`` consecutive runs whose sizes differ by one at most."""
    size, extra = divmod(len(cpus), parts)
    runs, start = [], 0
    for i in range(parts):
        stop = start + size + (1 if i < extra else 0)
        runs.append(tuple(cpus[start:stop]))
        start = stop
    return runs


@dataclass(frozen=True)
class CpuPlacement:
    """Where a process runs: ``cpus`` (a CPU list) or ``numa_node`` (all its usable CPUs), or neither
    (wherever the scheduler puts it)."""

    cpus: str | None = None
    numa_node: int | None = None

    def resolve(self, sysfs: Path = NUMA_SYSFS) -> tuple[int, ...] | None:
        """The CPUs to pin to (None: no pinning). ValueError, naming what there is, for CPUs this
        process may not use or a NUMA node that is not there."""
        if self.cpus is not None and self.numa_node is not None:
            raise ValueError("give --cpus or --numa-node, not both")
        usable = usable_cpus()
        if self.cpus is not None:
            wanted = parse_cpu_list(self.cpus)
            outside = [cpu for cpu in wanted if cpu not in usable]
            if outside:
                raise ValueError(f"CPU {format_cpu_list(outside)} is not among those this process may use ({format_cpu_list(usable)})")
            return wanted
        if self.numa_node is not None:
            nodes = numa_nodes(sysfs, usable)
            if self.numa_node not in nodes:
                there = ", ".join(f"{node} (CPUs {format_cpu_list(cpus)})" for node, cpus in nodes.items()) or "none the kernel reports"
                raise ValueError(f"NUMA node {self.numa_node} has no CPU this process may use; this host's NUMA nodes: {there}")
            return nodes[self.numa_node]
        return None


def pin_process(cpus: Iterable[int]) -> None:
    """Pin every thread of this process to ``cpus``, and the threads it starts later (they inherit the
    mask of the thread that starts them)."""
    mask = set(cpus)
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), mask)
        except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
            continue
    os.sched_setaffinity(0, mask)
    log.debug("pinned to CPUs %s", format_cpu_list(mask))


SPARE_FROM_CPUS = 4
"""From this many CPUs up, a node's update threads leave one of them free (:func:`update_threads`)."""


def update_threads(cpus: int, *, pass_thread: bool = False, store_io_threads: int = 0) -> int:
    """The update threads for a node on ``cpus`` CPUs: one per CPU but one from
    :data:`SPARE_FROM_CPUS` up. Each bucket's update pass ends when its slowest thread does; with a
    thread on every CPU, ZeroMQ's I/O thread and the node's own loop take a CPU from one of them at
    every message, and the pass waits for the thread they displaced (measured on a 16-core GPU host,
    the node on 14: 13 threads ran each bucket's pass faster than 14, and sent its values sooner).
    With ``pass_thread`` (``--pass-thread``) the loop runs beside the passes: two are left free.
    ``store_io_threads``: an out-of-core node's readers and writers of state files, which copy and
    checksum a bucket's state while the passes run; each is left a CPU as well, as long as the passes
    keep at least half of them."""
    if cpus < 1:
        raise ValueError(f"a node needs at least one CPU, not {cpus}")
    if store_io_threads < 0:
        raise ValueError(f"store_io_threads must be 0 or more, not {store_io_threads}")
    if cpus < SPARE_FROM_CPUS:
        return cpus
    spare = (2 if pass_thread else 1) + store_io_threads
    return max(cpus - spare, cpus // 2)


def run_on(cpus: Sequence[int], threads: int | None = None, *, pass_thread: bool = False, store_io_threads: int = 0) -> None:
    """Pin this process to ``cpus`` (:func:`pin_process`) with ``threads`` torch threads (default:
    :func:`update_threads`), before it starts its thread pools and writes its memory."""
    import torch

    pin_process(cpus)
    torch.set_num_threads(threads or update_threads(len(cpus), pass_thread=pass_thread, store_io_threads=store_io_threads))
