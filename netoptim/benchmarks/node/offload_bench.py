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

With ``--moments bf16`` or ``--moments 8bit`` the run compares instead two out-of-core stores on the
same buckets and ``--memory-budget`` (by default a quarter of the state with fp32 moments): one with
fp32 moments, one whose buckets keep their moments compressed
(:func:`~optimizer_node.moments.codec.codec_for`, one segment a bucket; a state file then holds the
fp32 parameters and the two encoded moments). Both update through the node's own call,
:func:`~optimizer_node.update.bucket_update.update_bucket` (the compiled loops, checked first). Their
steps take turns, each store's first step of a turn untimed so that the timed one overlaps its
predecessor's writes as in a run of steps, and the other store's writes are finished before a store's
turn, so neither waits for the other's disk. ``disk_bytes_ratio`` is the compressed store's bytes read
and written per step (its I/O counters) over the fp32 store's; ``ratio`` the compressed store's update
rate over the fp32 store's, the median over turns. No disk probe and no in-memory run then.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from netoptim.benchmarks.common import interleaved_seconds, median_ratio, vm_bytes
from optimizer_node.moments.codec import BF16_UNIT, MIN_COMPRESSED, MomentCodec, codec_for
from optimizer_node.state.disk_rate import measure_disk
from optimizer_node.state.ooc_store import OutOfCoreStore
from optimizer_node.state.storage import BucketState, BucketStore, InMemoryStore
from optimizer_node.update.adamw import AdamWHyper, adamw_update
from optimizer_node.update.bucket_update import update_bucket
from optimizer_node.update.kernels import compiled_update, moment_update
from optimizer_node.update.moment_pass import self_check
from optimizer_node.update.reduce import OrderedReduction

HYPER = AdamWHyper(1e-4, 0.9, 0.999, 1e-8, 0.01)


def _reset_peak_rss() -> None:
    """Start VmHWM afresh from the current RSS (Linux 4.0+; elsewhere the peak keeps its history)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass


def _adamw(state: BucketState, grad: torch.Tensor) -> None:
    """AdamW on the bucket's fp32 state with ``grad``, torch's kernel itself."""
    adamw_update(state.param, grad, state.exp_avg, state.exp_avg_sq, state.step_tensor, HYPER)


def _node_update(state: BucketState, grad: torch.Tensor) -> bool:
    """The node's update of the bucket (its moments in fp32 or compressed) with ``grad`` as one
    worker's gradient: an ``OrderedReduction`` and :func:`update_bucket`; whether the compiled loop did it."""
    # one fp32 frame of the whole bucket is the sum itself: the reduction does not ask for a buffer
    reduction = OrderedReduction(state.numel, 1, lambda: torch.empty(state.numel), defer=True)
    reduction.add(0, [(0, grad)])
    applied = update_bucket(
        state, reduction, HYPER, segments=((0, state.numel),), absent_everywhere=frozenset(), grad_divisor=torch.tensor(1.0),
        grad_multiplier=None, wire_out=None, previous_out=None, compiled=True,
    )  # fmt: skip
    return applied.compiled


def _run_steps(
    store: BucketStore,
    num_buckets: int,
    grad: torch.Tensor,
    steps: int,
    label: str,
    *,
    progress: bool = True,
    update: Callable[[BucketState, torch.Tensor], object] = _adamw,
) -> list[float]:
    """Wall time of each of ``steps`` steps over every bucket of ``store``: read ahead, acquired,
    ``update`` with ``grad``, released (written behind), as the daemon does."""
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
            update(state, grad)
            state.step += 1
            store.release(state, dirty=True)
            store.poll()
        times.append(time.perf_counter() - started)
    return times


def _fill(store: BucketStore, num_buckets: int, initial: torch.Tensor, codec: MomentCodec | None = None) -> None:
    for bucket_id in range(num_buckets):
        store.create(bucket_id, initial, codec)


def run(args: argparse.Namespace) -> dict:
    if getattr(args, "moments", "fp32") != "fp32":
        return run_moments(args)
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


def run_moments(args: argparse.Namespace) -> dict:
    """``--moments bf16|8bit``: out of core with fp32 moments against the same with compressed ones,
    in turns (see the module docstring)."""
    moments, block = args.moments, args.moment_block
    if moments not in ("bf16", "8bit"):
        raise ValueError(f"--moments {moments!r}: the compressed formats are bf16 and 8bit")
    codec = codec_for(moments, block, ((0, args.bucket_numel),))
    if codec is None or not all(layout.compressed for layout in codec.layouts):
        unit = block if moments == "8bit" else BF16_UNIT
        raise ValueError(
            f"--moments {moments}: a bucket of {args.bucket_numel} elements would keep fp32 moments (a compressed segment has at least "
            f"{MIN_COMPRESSED} elements and a multiple of {unit}); give a --bucket-numel that is a multiple of {unit}"
        )
    num_buckets = max(1, args.numel // args.bucket_numel)
    numel = num_buckets * args.bucket_numel
    formats: dict[str, MomentCodec | None] = {"fp32": None, "compressed": codec}
    state_bytes = {name: num_buckets * (4 * args.bucket_numel + 2 * (4 * args.bucket_numel if c is None else c.moment_bytes)) for name, c in formats.items()}
    budget = args.memory_budget or state_bytes["fp32"] // 4
    initial = torch.randn(args.bucket_numel, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(args.bucket_numel, generator=torch.Generator().manual_seed(1))
    # Both compiled loops checked (and compiled, or loaded from numba's cache) before any timing:
    # until then the node updates with torch ops, which is not what it does once a job has started.
    moment_update.wait_ready(self_check)
    compiled_update.usable()
    ran_compiled: dict[str, bool] = {}
    parent = Path(args.state_dir) if args.state_dir else Path.cwd()
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="netoptim-offload-", dir=parent) as workdir:
        stores: dict[str, OutOfCoreStore] = {}
        try:
            for name, c in formats.items():
                stores[name] = OutOfCoreStore(Path(workdir) / name, budget, io_threads=args.io_threads, sync=args.io == "sync")
                _fill(stores[name], num_buckets, initial, c)
                stores[name].flush()

            def turn(name: str) -> float:
                """One step of store ``name``, its own time; the other store's writes finish first, untimed."""
                for other, store in stores.items():
                    if other != name:
                        store.flush()
                compiled = True

                def update(state: BucketState, gradient: torch.Tensor) -> None:
                    nonlocal compiled
                    compiled = _node_update(state, gradient) and compiled

                seconds = _run_steps(stores[name], num_buckets, grad, 1, name, progress=False, update=update)[0]
                ran_compiled[name] = compiled
                return seconds

            # interleaved_seconds steps each store twice a turn and times the second step
            before = {name: store.io_counters() for name, store in stores.items()}
            times = interleaved_seconds({name: lambda name=name: turn(name) for name in stores}, args.repeats, label=f"out of core: fp32 and {moments} moments")
            disk_per_step = {}
            for name, store in stores.items():
                store.flush()  # the last step's writes behind count as that step's
                after = store.io_counters()
                moved = sum(after[key] - before[name][key] for key in ("bytes_read", "bytes_written"))
                disk_per_step[name] = round(moved / (2 * args.repeats))
        finally:
            for store in stores.values():
                store.close()

    rates = {name: numel / statistics.median(seconds) / 1e6 for name, seconds in times.items()}
    return {
        "benchmark": "offload",
        "moments": moments,
        "moment_block": block if moments == "8bit" else None,  # bf16 has no blocks
        "numel": numel,
        "bucket_numel": args.bucket_numel,
        "memory_budget": budget,
        "io": args.io,
        "io_threads": args.io_threads,
        "repeats": args.repeats,
        "ratio": round(median_ratio(times["fp32"], times["compressed"]), 3),
        "disk_bytes_ratio": round(disk_per_step["compressed"] / disk_per_step["fp32"], 4),
        "compiled_loop": ran_compiled["compressed"],
        "compiled_loop_fp32_moments": ran_compiled["fp32"],
        "fp32_moments_mparams_per_s": round(rates["fp32"], 1),
        "compressed_moments_mparams_per_s": round(rates["compressed"], 1),
        "fp32_moments_disk_bytes_per_step": disk_per_step["fp32"],
        "compressed_moments_disk_bytes_per_step": disk_per_step["compressed"],
        "fp32_moments_state_bytes": state_bytes["fp32"],
        "compressed_moments_state_bytes": state_bytes["compressed"],
    }
