"""``netoptim bench optimizer``: the node's update rate against torch's fused AdamW in the same run.

The node's work per bucket is what ``NodeDaemon`` does for it: the W workers' gradients arrive in
the wire dtype into an :class:`~optimizer_node.update.reduce.OrderedReduction` that leaves the sum to the
update pass, and :func:`~optimizer_node.update.bucket_pass.reduce_and_update` sums them in rank order and
applies AdamW in one pass (the compiled loop where numba is installed and agrees with torch's
kernel here, ``compiled_loop`` in the report; torch ops chunk by chunk otherwise), then writes the
outgoing copy in the wire dtype.

The node also keeps each bucket's parameters as they were, for a worker that restarts in the middle
of the step. With a 16-bit wire it keeps the outgoing copy it sent, which costs no pass; with an fp32
wire and two or more workers it copies them when the first gradient of the bucket arrives, while it
waits for the others, off the path from the last gradient to the new values that ``ratio`` measures.
``ratio_with_kept_copy`` is the same pass writing that copy too, as a node with one worker does
(4 bytes per parameter more, and a cache-line read for each line it writes). Where same-host workers
read a parameter board (fp32), the pass writes the new masters into the bucket's other slot instead
(``ratio_board``; the slot read is what is kept); ``ratio_board_copy`` is the way before, the masters
updated in place and copied onto the board.
They arrive last rank first, so every frame is held until the pass (with two workers every arrival
order gives the pass the same work). ``ratio`` is the node's work for pushes a worker vouched for
(:mod:`gpu_worker.exchange.finite_probe`: GPU and CPU workers do for every bucket pushed alone), which the
node does not read for NaN/inf; ``ratio_checked`` checks each arrival first, as the node does for a
push without the word (a batch of small buckets, ``--non-finite-check node``):
:func:`~optimizer_node.intake.non_finite.count_non_finite`.

Where the frames are matters as much as what is done with them. In the daemon a frame is checked
the moment the transport has written it, so it is in the last-level cache, and when the workers push
together the pass finds the bucket's frames there too. ``ratio`` and ``ratio_checked`` measure that:
before the node's turn with a bucket, each rank's frame is copied into a landing buffer (the
transport's write; staged, not timed), and the node's time is the pass (and the check of each arrival). ``ratio_cold_frames`` is
the same work on frames that were written long before (a worker that pushed long before the others),
read from memory by the check and again by the pass. ``finite_check_cost`` and
``finite_check_cost_cold`` are what the check adds against the same pass without it. The baseline
is ``torch.optim.AdamW(fused=True)`` stepping the same number of parameters, with the averaged
gradient already in place (it sums nothing, checks nothing and sends nothing). The runs take turns,
and each ratio is the median over rounds of the rates' ratio.

With ``--moments bf16`` or ``--moments 8bit`` (:attr:`~protos.job.spec.JobSpec.moments`) the node keeps
each bucket's moments compressed (:mod:`optimizer_node.moments`): the buckets are made by
:meth:`~optimizer_node.state.storage.InMemoryStore.create` with the bucket's codec (one segment a
bucket, so every element is compressed), the gradients come through an ``OrderedReduction`` and the
update is :func:`~optimizer_node.update.bucket_update.update_bucket`, the node's own call: AdamW decodes,
updates and encodes each piece in the compiled loop of
:mod:`~optimizer_node.update.kernels.moment_update` once its check against the torch-ops definition
has passed (waited for before timing; ``compiled_loop`` says whether it ran), torch ops otherwise.
The frames are read from memory, as the baseline reads its gradient. ``ratio`` is that update's rate
over torch's fused fp32 AdamW stepping the same parameters; ``ratio_over_fp32_moments`` is over the
same node update of buckets with fp32 moments, in the same rounds. ``bytes_per_param`` is the node's
memory traffic per parameter: the fp32 parameter read and written (8), each worker's gradient read,
both moments read and written as stored (8 bits: a byte of code and the block's share of its fp32
scale; bf16: 2 bytes), plus the outgoing cast of a 16-bit wire and, where the loop cannot take the
frames as they are (a 16-bit wire, more than two workers), the fp32 sum written and read once.
``state_bytes_per_param`` is what a parameter holds: 4 for its fp32 master value and its two moments
as stored (12 in all for fp32 moments).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from netoptim.benchmarks.common import bucket_sizes, interleaved_seconds, median_ratio, memory_bandwidth_gbs
from optimizer_node.intake.non_finite import count_non_finite
from optimizer_node.moments.codec import BF16_UNIT, MIN_COMPRESSED, bytes_per_element, codec_for
from optimizer_node.state.storage import BucketState, InMemoryStore
from optimizer_node.update.adamw import AdamWHyper
from optimizer_node.update.bucket_pass import reduce_and_update
from optimizer_node.update.bucket_update import update_bucket
from optimizer_node.update.kernels import compiled_update, moment_update
from optimizer_node.update.moment_pass import self_check
from optimizer_node.update.reduce import OrderedReduction

FUSED_ADAMW_BYTES_PER_PARAM = 4 * 7
"""torch's fused AdamW reads the parameter, both moments and the gradient, and writes the first three."""


def node_bytes_per_param(workers: int, wire_bytes: int, *, frames_in_cache: bool = False) -> int:
    """Memory traffic of the node's one-pass update per parameter: each worker's gradient is read
    once (from the cache when the frames have just landed: ``frames_in_cache``), the parameter and
    both moments are read and written, and a non-fp32 wire writes the cast copy. The sum and the
    averaged gradient stay in cache (a block of the compiled loop, a chunk of the torch-ops path),
    and so do most of the parameters the cast reads right after the update."""
    cast = 0 if wire_bytes == 4 else wire_bytes
    return (0 if frames_in_cache else workers * wire_bytes) + 4 * 6 + cast


def compressed_bytes_per_param(workers: int, wire_bytes: int, moments: str, block: int) -> float:
    """Memory traffic per parameter of the node's update of a bucket with compressed moments: the
    fp32 parameter read and written, each worker's gradient read in the wire dtype, both moments read
    and written as stored (:func:`~optimizer_node.moments.codec.bytes_per_element`: codes and scales
    in 8 bits, bf16 values), a 16-bit wire's outgoing cast written, and the fp32 sum written and read
    where the compiled loop does not take the frames themselves (16-bit frames, more than two)."""
    cast = 0 if wire_bytes == 4 else wire_bytes
    summed = 8 if wire_bytes != 4 or workers > 2 else 0
    return 8 + workers * wire_bytes + 2 * bytes_per_element(moments, block) + cast + summed


def compressible_sizes(numel: int, bucket_numel: int, moments: str, block: int) -> list[int]:
    """The bucket sizes of ``numel`` parameters, each a segment the codec compresses whole;
    ``ValueError`` for a size it would keep in fp32 (too small, or not a whole number of blocks)."""
    sizes = bucket_sizes(numel, bucket_numel)
    unit = block if moments == "8bit" else BF16_UNIT
    for size in sorted(set(sizes)):
        codec = codec_for(moments, block, ((0, size),))
        if codec is None or not all(layout.compressed for layout in codec.layouts):
            raise ValueError(
                f"--moments {moments}: a bucket of {size} elements would keep fp32 moments (a compressed segment has at least "
                f"{MIN_COMPRESSED} elements and a multiple of {unit}); give --numel and --bucket-numel that are multiples of {unit}"
            )
    return sizes


def run(args: argparse.Namespace) -> dict:
    if getattr(args, "moments", "fp32") != "fp32":
        return run_compressed(args)
    wire_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.wire_dtype]
    sizes = bucket_sizes(args.numel, args.bucket_numel)
    num_buckets, numel = len(sizes), args.numel
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=generator) for n in sizes]
    exp_avgs = [torch.zeros(n) for n in sizes]
    exp_avg_sqs = [torch.zeros(n) for n in sizes]
    steps = [torch.zeros(()) for _ in sizes]
    scratch = [torch.empty(n) for n in sizes]  # the reduction's buffer; the pass does not need it
    wire_out = [torch.empty(n, dtype=wire_dtype) for n in sizes] if wire_dtype != torch.float32 else None
    kept = [torch.empty(n) for n in sizes] if wire_dtype == torch.float32 else None  # the values a restarted worker may need
    # fp32 with same-host workers: the parameter board's other slot a bucket, where the masters go (or, the way before, a copy of them)
    board = [torch.empty(n) for n in sizes] if wire_dtype == torch.float32 else None
    frames = [[torch.randn(n, generator=generator).to(wire_dtype) for _ in range(args.workers)] for n in sizes]
    hyper = AdamWHyper(1e-4, 0.9, 0.999, 1e-8, 0.01)
    divisor = torch.tensor(float(args.workers))

    landing = [torch.empty(max(sizes), dtype=wire_dtype) for _ in range(args.workers)]  # where the transport writes each rank's frame

    def node_update(keep_copy: bool = False, check: bool = True, landed: bool = True, onto_board: str | None = None) -> float:
        """The node's work on every bucket; returns its own time (a frame's landing is not the node's).
        ``onto_board``: ``"masters"`` (the new values into the board's other slot, which then holds the
        masters) or ``"copy"`` (updated in place, then copied onto the board)."""
        seconds = 0.0
        for index in range(num_buckets):
            reduction = OrderedReduction(sizes[index], args.workers, lambda index=index: scratch[index], defer=True)
            for rank in reversed(range(args.workers)):
                frame = frames[index][rank]
                if landed:
                    frame = landing[rank][: sizes[index]].copy_(frame)
                started = time.perf_counter()
                pieces = [(0, frame)]
                if check and count_non_finite(pieces):
                    raise AssertionError("the benchmark's gradients are finite")
                reduction.add(rank, pieces)
                seconds += time.perf_counter() - started
            wire = None if wire_out is None else wire_out[index]
            if onto_board == "copy" and board is not None:
                wire = board[index]
            beside = board[index] if onto_board == "masters" and board is not None else None
            previous = kept[index] if keep_copy and kept is not None else None
            started = time.perf_counter()
            reduce_and_update(
                reduction, params[index], exp_avgs[index], exp_avg_sqs[index], steps[index], hyper,
                grad_divisor=divisor, wire_out=wire, previous_out=previous, param_out=beside,
            )  # fmt: skip
            seconds += time.perf_counter() - started
            if beside is not None and board is not None:  # the slot written holds the masters; the next update writes the other
                params[index], board[index] = beside, params[index]
        return seconds

    baseline_params = [torch.nn.Parameter(p.clone()) for p in params]
    for p, per_bucket in zip(baseline_params, frames, strict=True):
        p.grad = per_bucket[0].float()
    fused = torch.optim.AdamW(baseline_params, lr=1e-4, weight_decay=0.01, fused=True)

    compiled = compiled_update.usable()  # the check (and numba's compilation) before any timing
    timed = {
        "node": node_update,
        "fused": fused.step,
        "node_unchecked": lambda: node_update(check=False),
        "node_cold": lambda: node_update(landed=False),
        "node_cold_unchecked": lambda: node_update(check=False, landed=False),
    }
    if kept is not None:
        timed["node_keeping"] = lambda: node_update(keep_copy=True)
    if board is not None:
        timed["node_board"] = lambda: node_update(check=False, onto_board="masters")
        timed["node_board_copy"] = lambda: node_update(check=False, onto_board="copy")
    times = interleaved_seconds(timed, args.repeats, label="node update and torch fused AdamW")
    node_s, fused_s = statistics.median(times["node"]), statistics.median(times["fused"])
    bandwidth = memory_bandwidth_gbs(args.repeats)
    node_rate, fused_rate = numel / node_s / 1e6, numel / fused_s / 1e6
    bytes_per_param = node_bytes_per_param(args.workers, wire_dtype.itemsize, frames_in_cache=True)
    bytes_cold = node_bytes_per_param(args.workers, wire_dtype.itemsize)
    return {
        "benchmark": "optimizer",
        # the default: a worker vouches for each lone bucket's gradient (finite_probe), the node reads it once
        "ratio": round(median_ratio(times["fused"], times["node_unchecked"]), 3),
        "ratio_checked": round(median_ratio(times["fused"], times["node"]), 3),
        "ratio_with_kept_copy": round(median_ratio(times["fused"], times["node_keeping"]), 3) if kept is not None else None,
        # fp32 with same-host workers: the masters on the parameter board, and the way before (a copy onto it)
        "ratio_board": round(median_ratio(times["fused"], times["node_board"]), 3) if board is not None else None,
        "ratio_board_copy": round(median_ratio(times["fused"], times["node_board_copy"]), 3) if board is not None else None,
        "ratio_cold_frames": round(median_ratio(times["fused"], times["node_cold_unchecked"]), 3),
        "ratio_cold_frames_checked": round(median_ratio(times["fused"], times["node_cold"]), 3),
        "finite_check_cost": round(median_ratio(times["node"], times["node_unchecked"]) - 1, 3),
        "finite_check_cost_cold": round(median_ratio(times["node_cold"], times["node_cold_unchecked"]) - 1, 3),
        "numel": numel,
        "bucket_numel": args.bucket_numel,
        "buckets": num_buckets,
        "workers": args.workers,
        "wire_dtype": args.wire_dtype,
        "threads": torch.get_num_threads(),
        "compiled_loop": compiled,
        "repeats": args.repeats,
        "node_mparams_per_s": round(numel / statistics.median(times["node_unchecked"]) / 1e6, 1),
        "node_checked_mparams_per_s": round(node_rate, 1),
        "node_cold_frames_mparams_per_s": round(numel / statistics.median(times["node_cold_unchecked"]) / 1e6, 1),
        "torch_fused_adamw_mparams_per_s": round(fused_rate, 1),
        "memory_bandwidth_gbs": round(bandwidth, 1),
        "node_bytes_per_param": bytes_per_param,
        "node_bandwidth_bound_mparams_per_s": round(bandwidth * 1e3 / bytes_per_param, 1),
        "node_bytes_per_param_cold_frames": bytes_cold,
        "node_cold_frames_bandwidth_bound_mparams_per_s": round(bandwidth * 1e3 / bytes_cold, 1),
        "fused_adamw_bandwidth_bound_mparams_per_s": round(bandwidth * 1e3 / FUSED_ADAMW_BYTES_PER_PARAM, 1),
    }


def run_compressed(args: argparse.Namespace) -> dict:
    """``--moments bf16|8bit``: the node's update of buckets with compressed moments
    (:func:`~optimizer_node.update.bucket_update.update_bucket`) against torch's fused fp32 AdamW, and
    against the same update of buckets with fp32 moments, interleaved; see the module docstring."""
    moments, block = args.moments, args.moment_block
    if moments not in ("bf16", "8bit"):
        raise ValueError(f"--moments {moments!r}: the compressed formats are bf16 and 8bit")
    wire_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.wire_dtype]
    sizes = compressible_sizes(args.numel, args.bucket_numel, moments, block)
    num_buckets, numel = len(sizes), args.numel
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(n, generator=generator) for n in sizes]
    frames = [[torch.randn(n, generator=generator).to(wire_dtype) for _ in range(args.workers)] for n in sizes]
    segments = [((0, n),) for n in sizes]
    compressed_store, fp32_store = InMemoryStore(), InMemoryStore()
    compressed = [compressed_store.create(index, initial[index], codec_for(moments, block, segments[index])) for index in range(num_buckets)]
    plain = [fp32_store.create(index, initial[index]) for index in range(num_buckets)]
    wire_out = [torch.empty(n, dtype=wire_dtype) for n in sizes] if wire_dtype != torch.float32 else None
    hyper = AdamWHyper(1e-4, 0.9, 0.999, 1e-8, 0.01)
    divisor = torch.tensor(float(args.workers))
    ran_compiled: dict[str, bool] = {}

    def node_update(states: list[BucketState], name: str) -> None:
        """Every bucket's gradients into a reduction (last rank first: every frame is held until the
        pass, as in the fp32 benchmark) and the node's update of it; records whether the compiled loop
        did every bucket."""
        every = True
        for index, state in enumerate(states):
            reduction = OrderedReduction(sizes[index], args.workers, state.reduction_buffer, defer=True)
            for rank in reversed(range(args.workers)):
                reduction.add(rank, [(0, frames[index][rank])])
            applied = update_bucket(
                state, reduction, hyper, segments=segments[index], absent_everywhere=frozenset(), grad_divisor=divisor,
                grad_multiplier=None, wire_out=None if wire_out is None else wire_out[index], previous_out=None, compiled=True,
            )  # fmt: skip
            every = every and applied.compiled
        ran_compiled[name] = every

    baseline_params = [torch.nn.Parameter(p.clone()) for p in initial]
    for p, per_bucket in zip(baseline_params, frames, strict=True):
        p.grad = per_bucket[0].float()
    fused = torch.optim.AdamW(baseline_params, lr=1e-4, weight_decay=0.01, fused=True)

    # Both compiled loops checked (and compiled, or loaded from numba's cache) before any timing: until
    # then the node updates with torch ops, which is not what a node does once a job has started.
    moment_update.wait_ready(self_check)
    compiled_update.usable()
    timed = {
        "node": lambda: node_update(compressed, "node"),
        "fused": fused.step,
        "node_fp32_moments": lambda: node_update(plain, "node_fp32_moments"),
    }
    times = interleaved_seconds(timed, args.repeats, label=f"node update with {moments} moments and torch fused AdamW")
    bandwidth = memory_bandwidth_gbs(args.repeats)
    bytes_per_param = compressed_bytes_per_param(args.workers, wire_dtype.itemsize, moments, block)
    rates = {name: numel / statistics.median(seconds) / 1e6 for name, seconds in times.items()}
    return {
        "benchmark": "optimizer",
        "moments": moments,
        "moment_block": block if moments == "8bit" else None,  # bf16 has no blocks
        "ratio": round(median_ratio(times["fused"], times["node"]), 3),
        "ratio_over_fp32_moments": round(median_ratio(times["node_fp32_moments"], times["node"]), 3),
        "compiled_loop": ran_compiled["node"],
        "compiled_loop_fp32_moments": ran_compiled["node_fp32_moments"],
        "numel": numel,
        "bucket_numel": args.bucket_numel,
        "buckets": num_buckets,
        "workers": args.workers,
        "wire_dtype": args.wire_dtype,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "node_mparams_per_s": round(rates["node"], 1),
        "node_fp32_moments_mparams_per_s": round(rates["node_fp32_moments"], 1),
        "torch_fused_adamw_mparams_per_s": round(rates["fused"], 1),
        "bytes_per_param": bytes_per_param,
        "fused_adamw_bytes_per_param": FUSED_ADAMW_BYTES_PER_PARAM,
        "state_bytes_per_param": 4 + bytes_per_element(moments, block),
        "fused_adamw_state_bytes_per_param": 12,
        "memory_bandwidth_gbs": round(bandwidth, 1),
        "node_bandwidth_bound_mparams_per_s": round(bandwidth * 1e3 / bytes_per_param, 1),
        "fused_adamw_bandwidth_bound_mparams_per_s": round(bandwidth * 1e3 / FUSED_ADAMW_BYTES_PER_PARAM, 1),
    }
