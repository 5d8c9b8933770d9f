"""A disk's own sequential write and read rates, as an out-of-core node would see them: what ``netoptim
bench offload`` calls the disk bound and ``netoptim doctor --state-dir`` reports. The probe writes
and reads one file in 16 MiB requests, fdatasync and the page cache dropped after each pass so that
the disk is measured, not the cache; through the page cache, or with ``O_DIRECT`` from page-aligned
memory as the store does with ``--sync-state-writes``."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from optimizer_node.state.ooc_files import O_DIRECT, probe_direct_io, state_buffer

PROBE_BLOCK = 16 << 20


def _probe_buffer() -> memoryview:
    buffer = state_buffer(PROBE_BLOCK // 4)  # page-aligned (and on huge pages), as the store's
    buffer.fill_(1.0)
    return memoryview(buffer.numpy()).cast("B")


def make_probe_file(directory: Path, nbytes: int) -> Path:
    """The file the disk is measured on, written once beforehand: the store overwrites the blocks
    of retired versions, so the bound is the disk's speed too, not the file system's allocation."""
    path = directory / "disk-probe.bin"
    data = _probe_buffer()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for index in range(max(1, nbytes // PROBE_BLOCK)):
            os.pwrite(fd, data, index * PROBE_BLOCK)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return path


def disk_bound(path: Path, nbytes: int, *, direct: bool) -> tuple[float, float] | None:
    """Sequential write (then fdatasync) and read of ``nbytes`` over the probe file, in GB/s, through
    the page cache (dropped after each pass) or, with ``direct``, with ``O_DIRECT``; None where the
    file system refuses ``O_DIRECT``."""
    if direct and not probe_direct_io(path.parent):
        return None
    data = _probe_buffer()
    blocks = max(1, nbytes // PROBE_BLOCK)
    flag = O_DIRECT if direct else 0
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | flag)
    try:
        for index in range(blocks):
            os.pwrite(fd, data, index * PROBE_BLOCK)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    write_s = time.perf_counter() - started
    started = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | flag)
    try:
        for index in range(blocks):
            os.preadv(fd, [data], index * PROBE_BLOCK)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    read_s = time.perf_counter() - started
    return blocks * PROBE_BLOCK / write_s / 1e9, blocks * PROBE_BLOCK / read_s / 1e9


@dataclass(frozen=True, slots=True)
class DiskRates:
    """Medians of repeated probes, GB/s, per way of moving the bytes (``"buffered"``, ``"direct"``)."""

    write_gbs: dict[str, float]
    read_gbs: dict[str, float]

    @property
    def best_write_gbs(self) -> float:
        return max(self.write_gbs.values())

    @property
    def best_read_gbs(self) -> float:
        return max(self.read_gbs.values())


def measure_disk(directory: Path, nbytes: int, repeats: int = 1) -> DiskRates:
    """The disk under ``directory`` written and read ``repeats`` times over a probe file of ``nbytes``
    (removed after), through the page cache and with ``O_DIRECT`` where the file system takes it,
    alternated so that both see the same load."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, not {repeats}")
    probes: dict[str, list[tuple[float, float]]] = {"buffered": [], "direct": []}
    path = make_probe_file(directory, nbytes)
    try:
        for _ in range(repeats):
            for mode in probes:
                if (probe := disk_bound(path, nbytes, direct=mode == "direct")) is not None:
                    probes[mode].append(probe)
    finally:
        path.unlink(missing_ok=True)
    runs = {mode: found for mode, found in probes.items() if found}
    return DiskRates(
        {mode: statistics.median(write for write, _read in found) for mode, found in runs.items()},
        {mode: statistics.median(read for _write, read in found) for mode, found in runs.items()},
    )
