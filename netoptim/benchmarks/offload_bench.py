"""``netoptim bench offload``: the out-of-core store's update rate against the disk's own speed.

In one run, over the same number of parameters in buckets of ``--bucket-numel``:

- the disk bound: write the whole state to one file sequentially and read it back (fdatasync and
  the page cache dropped, so the disk itself is measured), through the page cache and with
  ``O_DIRECT``, the faster of the two kept for each direction; an out-of-core step must read and
  write every byte of state once, so the best possible rate is ``params / (state/read_bw + state/write_bw)``;
- out of core: every bucket acquired (read ahead), updated with AdamW and released (written behind)
  through :class:`~optimizer_node.state.ooc_store.OutOfCoreStore` under ``--memory-budget``, as the daemon
  does; the peak RSS it added (from after a two-bucket warm-up store has paged in the code) is
  measured against the budget;
- in memory: the same loop over :class:`~optimizer_node.state.storage.InMemoryStore`.

``ratio`` is the out-of-core rate over the disk bound. With ``--io buffered`` and more free RAM than
state, the page cache keeps what the store writes and serves its reads: the ratio can pass 1, and
what it then measures is the store's own CPU cost (copies, checksums), not the disk.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from netoptim.benchmarks.common import vm_bytes
from optimizer_node.state.disk_rate import measure_disk
from optimizer_node.state.ooc_store import OutOfCoreStore
from optimizer_node.state.storage import BucketStore, InMemoryStore
from optimizer_node.update.adamw import AdamWHyper, adamw_update


def _reset_peak_rss() -> None:
    """Start VmHWM afresh from the current RSS (Linux 4.0+; elsewhere the peak keeps its history)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass


def _run_steps(store: BucketStore, num_buckets: int, grad: torch.Tensor, steps: int, label: str, *, progress: bool = True) -> list[float]:
    hyper = AdamWHyper(1e-4, 0.9, 0.999, 1e-8, 0.01)
    times = []
    for _ in tqdm(range(steps), desc=label, leave=False, disable=not progress):
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


def _fill(store: BucketStore, num_buckets: int, initial: torch.Tensor) -> None:
    for bucket_id in range(num_buckets):
        store.create(bucket_id, initial)


def run(args: argparse.Namespace) -> dict:
    num_buckets = max(1, args.numel // args.bucket_numel)
    numel = num_buckets * args.bucket_numel
    state_bytes = 12 * numel
    budget = args.memory_budget or state_bytes // 4
    # The inputs exist before the RSS is measured: they are the caller's memory, not the store's.
    initial = torch.randn(args.bucket_numel, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(args.bucket_numel, generator=torch.Generator().manual_seed(1))
    parent = Path(args.state_dir) if args.state_dir else Path.cwd()
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="netoptim-offload-", dir=parent) as workdir:
        # The disk's speed is the faster of the two ways to move the bytes: through the page cache,
        # and O_DIRECT from huge pages, as the store does with --io sync (no copies, and requests of
        # the device's maximum size). Alternated, so both see the same load.
        disk = measure_disk(Path(workdir), state_bytes, args.repeats)
        write_gbs, read_gbs = disk.best_write_gbs, disk.best_read_gbs
        bound_s = state_bytes / (write_gbs * 1e9) + state_bytes / (read_gbs * 1e9)

        # A two-bucket store first, so that the code the store runs (torch's kernels, zlib, the file
        # I/O) is paged in before the RSS is measured: it is library code, not memory the budget
        # bounds. The peak is then counted from here, not from the probes' buffers.
        warm = OutOfCoreStore(Path(workdir) / "warm-up", 12 * 1024, io_threads=args.io_threads, sync=args.io == "sync")
        _fill(warm, 2, initial[:1024])
        _run_steps(warm, 2, grad[:1024], 2, "warm-up", progress=False)
        warm.close()
        _reset_peak_rss()
        rss_before = vm_bytes("VmRSS")
        store = OutOfCoreStore(Path(workdir) / "state", budget, io_threads=args.io_threads, sync=args.io == "sync")
        _fill(store, num_buckets, initial)
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
        ooc_peak = vm_bytes("VmHWM") - rss_before
        store.close()

    memory = InMemoryStore()
    _fill(memory, num_buckets, initial)
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
        "disk_gbs_by_method": {mode: {"write": disk.write_gbs[mode], "read": disk.read_gbs[mode]} for mode in disk.write_gbs},
        "bytes_read_per_step": read_per_step,
        "bytes_written_per_step": written_per_step,
        "out_of_core_peak_rss_added": ooc_peak,
        "peak_rss_over_budget": ooc_peak / budget,
    }
