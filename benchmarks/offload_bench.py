"""``netoptim bench offload``: the out-of-core store's update rate against the disk's own speed.

In one run, over the same number of parameters in buckets of ``--bucket-numel``:

- the disk bound: write the whole state to one file sequentially and read it back (fdatasync and
  the page cache dropped, so the disk itself is measured); an out-of-core step must read and write
  every byte of state once, so the best possible rate is ``params / (state/read_bw + state/write_bw)``;
- out of core: every bucket acquired (read ahead), updated with AdamW and released (written behind)
  through :class:`~optimizer_node.ooc_store.OutOfCoreStore` under ``--memory-budget``, as the daemon
  does; the peak RSS it added is measured against the budget;
- in memory: the same loop over :class:`~optimizer_node.storage.InMemoryStore`.

``ratio`` is the out-of-core rate over the disk bound.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from optimizer_node.adamw import AdamWHyper, adamw_update
from optimizer_node.ooc_store import OutOfCoreStore
from optimizer_node.storage import BucketStore, InMemoryStore


def _vm(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def disk_bound(directory: Path, nbytes: int, block: int = 16 << 20) -> tuple[float, float]:
    """Sequential write then read of ``nbytes`` in ``directory``, bypassing the page cache; GB/s."""
    path = directory / "disk-probe.bin"
    data = memoryview(torch.ones(block // 4).numpy()).cast("B")
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(max(1, nbytes // block)):
            os.write(fd, data)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    write_s = time.perf_counter() - started
    buffer = bytearray(block)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        while handle.readinto(buffer):
            pass
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    read_s = time.perf_counter() - started
    path.unlink()
    total = max(1, nbytes // block) * block
    return total / write_s / 1e9, total / read_s / 1e9


def _run_steps(store: BucketStore, num_buckets: int, grad: torch.Tensor, steps: int, label: str) -> list[float]:
    hyper = AdamWHyper(1e-4, 0.9, 0.999, 1e-8, 0.01)
    times = []
    for _ in tqdm(range(steps), desc=label, leave=False):
        started = time.perf_counter()
        for bucket_id in range(num_buckets):
            for ahead in (1, 2):  # what the daemon does with its ready queue
                if bucket_id + ahead < num_buckets:
                    store.prefetch(bucket_id + ahead)
            state = store.get(bucket_id)
            assert state is not None
            store.acquire(state)
            adamw_update(state.param, grad, state.exp_avg, state.exp_avg_sq, state.step_tensor, hyper)
            state.step += 1
            store.release(state, dirty=True)
            store.poll()
        times.append(time.perf_counter() - started)
    return times


def _fill(store: BucketStore, num_buckets: int, bucket_numel: int) -> None:
    initial = torch.randn(bucket_numel, generator=torch.Generator().manual_seed(0))
    for bucket_id in range(num_buckets):
        store.create(bucket_id, initial)


def run(args: argparse.Namespace) -> dict:
    num_buckets = max(1, args.numel // args.bucket_numel)
    numel = num_buckets * args.bucket_numel
    state_bytes = 12 * numel
    budget = args.memory_budget or state_bytes // 4
    grad = torch.randn(args.bucket_numel, generator=torch.Generator().manual_seed(1))
    parent = Path(args.state_dir) if args.state_dir else Path.cwd()
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="netoptim-offload-", dir=parent) as workdir:
        probes = [disk_bound(Path(workdir), state_bytes) for _ in range(args.repeats)]
        write_gbs, read_gbs = statistics.median(p[0] for p in probes), statistics.median(p[1] for p in probes)
        bound_s = state_bytes / (write_gbs * 1e9) + state_bytes / (read_gbs * 1e9)

        rss_before = _vm("VmRSS")
        store = OutOfCoreStore(Path(workdir) / "state", budget, io_threads=args.io_threads, sync=args.io == "sync")
        _fill(store, num_buckets, args.bucket_numel)
        _run_steps(store, num_buckets, grad, 1, "out of core (warm-up)")
        # Writes run behind the updates: count the bytes of whole steps, not of the writes that happened
        # to finish inside the timed window (the first timed step has no writes of a previous one to
        # overlap, the last leaves its own in flight: the two roughly cancel in the timing).
        store.flush()
        read0, written0 = store.bytes_read, store.bytes_written
        ooc_times = _run_steps(store, num_buckets, grad, args.repeats, "out of core")
        store.flush()
        read_per_step = (store.bytes_read - read0) / args.repeats
        written_per_step = (store.bytes_written - written0) / args.repeats
        ooc_peak = _vm("VmHWM") - rss_before
        store.close()

    memory = InMemoryStore()
    _fill(memory, num_buckets, args.bucket_numel)
    _run_steps(memory, num_buckets, grad, 1, "in memory (warm-up)")
    mem_times = _run_steps(memory, num_buckets, grad, args.repeats, "in memory")

    ooc_rate = numel / statistics.median(ooc_times) / 1e6
    bound_rate = numel / bound_s / 1e6
    return {
        "benchmark": "offload",
        "numel": numel,
        "state_bytes": state_bytes,
        "memory_budget": budget,
        "io": args.io,
        "io_threads": args.io_threads,
        "ratio": ooc_rate / bound_rate,
        "out_of_core_mparams_per_s": ooc_rate,
        "disk_bound_mparams_per_s": bound_rate,
        "in_memory_mparams_per_s": numel / statistics.median(mem_times) / 1e6,
        "disk_write_gbs": write_gbs,
        "disk_read_gbs": read_gbs,
        "bytes_read_per_step": read_per_step,
        "bytes_written_per_step": written_per_step,
        "out_of_core_peak_rss_added": ooc_peak,
        "peak_rss_over_budget": ooc_peak / budget,
    }
