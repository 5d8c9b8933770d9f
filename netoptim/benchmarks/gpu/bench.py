"""``netoptim bench gpu``: GPT training on one GPU, netoptim against DeepSpeed's CPU offload.

For each model size and dtype, in one run, with the same batches (``--batch`` x ``--seq`` tokens a
step), each mode in a fresh process on GPU 0:

- ``compute``: forward and backward alone (the GPU's share of any step);
- ``torch``: the model and ``torch.optim.AdamW(fused=True)`` all on the GPU, where it fits (the ceiling);
- ``full``: netoptim full model (``RemoteAdamW``, pushing during backward) with local optimizer nodes;
- ``layerwise``: netoptim layer-wise (``gpu_worker.offload``, the model built on the meta device);
- ``zero2`` / ``zero3``: DeepSpeed ZeRO-2 with its optimizer on the CPU, ZeRO-3 with parameters and
  optimizer on the CPU (``pip install 'netoptim-train[bench]'``).

In bfloat16 the model computes in bf16 in every mode; netoptim sends bf16 on the wire and the
nodes keep fp32 masters, as DeepSpeed's bf16 mode keeps fp32 masters in its CPU optimizer.

The run also measures the box's limits (pinned bandwidth each way, torch's fused CPU AdamW at all
cores) and reports, per mode, the fraction of the *offload limit*: the step time if the slowest of
GPU compute, gradients down, parameters up and the CPU update hid all the others.
Without CUDA it says so and exits 0 without a figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from gpu_worker.layerwise.copy_rates import copy_bandwidth_gbs
from gpu_worker.models import GPTConfig
from netoptim.benchmarks.common import check_node_args, node_flag, store_io_threads
from netoptim.benchmarks.gpu.limits import cpu_adamw_mparams, node_update_mparams, offload_limit_step_s
from netoptim.benchmarks.gpu.limits_file import check_same_box
from netoptim.benchmarks.gpu.mode_names import MODES, NETOPTIM_MODES
from netoptim.benchmarks.gpu.modes import DTYPES, ModeSettings, train_mode
from netoptim.benchmarks.gpu.table import table
from netoptim.benchmarks.train_bench import param_count
from netoptim.launch.host_cpus import format_cpu_list, numa_nodes, pin_process, split_cpus, update_threads, usable_cpus
from transport.shm.window import shared_huge_pages

log = logging.getLogger(__name__)

SIZES = {
    "small": GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=256),
    "350m": GPTConfig(vocab_size=256, block_size=64, n_layer=28, n_head=16, n_embd=1024),
    "1b": GPTConfig(vocab_size=256, block_size=64, n_layer=20, n_head=16, n_embd=2048),
    "3b": GPTConfig(vocab_size=256, block_size=64, n_layer=32, n_head=32, n_embd=2560),
    "7b": GPTConfig(vocab_size=256, block_size=64, n_layer=32, n_head=32, n_embd=4096),
}
# GPU bytes per parameter beyond activations, per mode and model dtype (fp32 | bf16): what decides
# whether a mode is tried at all. torch holds weights, gradients and two moments.
GPU_BYTES_PER_PARAM = {"torch": (16, 8), "compute": (8, 4), "full": (8, 4), "zero2": (8, 4)}


# Host bytes per parameter of the hungriest mode (netoptim: the node's state, board, kept values and
# gradients in flight, the worker's pinned buffers), and GPU bytes of the full model: what "largest" fits.
HOST_BYTES_PER_PARAM, FULL_GPU_BYTES_PER_PARAM = 28, 8


def largest_fitting(host_bytes: int, gpu_bytes: int) -> str:
    """The largest of :data:`SIZES` that every offloaded mode can run here (``--sizes largest``)."""
    for size in sorted(SIZES, key=lambda name: param_count(SIZES[name]), reverse=True):
        params = param_count(SIZES[size])
        if params * HOST_BYTES_PER_PARAM <= 0.8 * host_bytes and params * FULL_GPU_BYTES_PER_PARAM <= 0.85 * gpu_bytes:
            return size
    return "small"


def _child(target, args: tuple, results: mp.Queue) -> None:
    try:
        results.put({"ok": target(*args)})
    except BaseException as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)})


def in_child(target, args: tuple, timeout_s: float) -> dict:
    """``target(*args)`` in a fresh spawned process (its own CUDA context, peak memory and RSS)."""
    context = mp.get_context("spawn")
    results: mp.Queue = context.Queue()
    process = context.Process(target=_child, args=(target, args, results))
    process.start()
    try:
        outcome = results.get(timeout=timeout_s)
    except Exception:
        outcome = {"error": f"no result within {timeout_s:.0f} s"}
    except BaseException:  # the run is ending (Ctrl-C, SIGTERM): the child must not train on alone
        process.kill()
        process.join()
        raise
    process.join(30)
    if process.is_alive():
        process.kill()
        process.join()
    return outcome


@dataclass(frozen=True)
class HostSplit:
    """How the worker and the local nodes share this host's CPUs: pinned to disjoint sets (``--pin``),
    or wherever the scheduler puts them, with the node threads summing to the cores the worker leaves."""

    node_threads: int
    node_cpus: tuple[tuple[int, ...], ...] = ()  # one set per node; empty: not pinned
    worker_cpus: tuple[int, ...] = ()

    def describe(self) -> dict:
        return {
            "node_threads": self.node_threads,
            "node_cpus": [format_cpu_list(cpus) for cpus in self.node_cpus] or None,
            "worker_cpus": format_cpu_list(self.worker_cpus) if self.worker_cpus else None,
        }


def host_split(nodes: int, node_threads: int | None, pin: bool, worker_cpus: int, *, pass_thread: bool = False, store_io_threads: int = 0) -> HostSplit:
    """The worker gets the first ``worker_cpus`` usable CPUs; pinned, each node gets a disjoint set of
    the rest (NUMA nodes kept whole where the counts allow) and :func:`update_threads` of them unless
    ``node_threads`` says (``pass_thread``: the nodes run with ``--pass-thread``; ``store_io_threads``:
    an out-of-core node's state-file readers and writers); unpinned, the nodes share the cores the
    worker leaves, as many threads again. ValueError if the CPUs do not go round."""
    usable = usable_cpus()
    spare = {"pass_thread": pass_thread, "store_io_threads": store_io_threads}
    if not pin:
        return HostSplit(node_threads or update_threads(max(1, (len(usable) - worker_cpus) // nodes), **spare))
    if len(usable) < worker_cpus + nodes:
        raise ValueError(f"--pin: {nodes} node(s) and --worker-cpus {worker_cpus} need {worker_cpus + nodes} CPUs; this process may use {len(usable)}")
    sets = tuple(split_cpus(usable[worker_cpus:], nodes, numa_nodes(usable=usable)))
    return HostSplit(node_threads or update_threads(min(len(cpus) for cpus in sets), **spare), sets, usable[:worker_cpus])


def measure_limits(device: torch.device, copy_bytes: int, adam_numel: int, split: HostSplit, bucket_numel: int) -> dict:
    """The box's limits (see :mod:`netoptim.benchmarks.gpu.limits`), in this process: the node's update pass
    last, in the job's buckets, on the first node's CPUs where the nodes are pinned."""
    limits = copy_bandwidth_gbs(device, copy_bytes) | cpu_adamw_mparams(adam_numel)
    if split.node_cpus:
        pin_process(split.node_cpus[0])
    return limits | node_update_mparams(split.node_threads, adam_numel, bucket_numel)


def run_mode(mode: str, size: str, dtype_name: str, settings: ModeSettings, device: torch.device, args: argparse.Namespace, split: HostSplit) -> dict:
    """One mode in a fresh process, with its own local nodes (``args.nodes``) for the netoptim modes."""
    from netoptim.launch.processes import NodeProcess

    config = SIZES[size]
    with tempfile.TemporaryDirectory(prefix="netoptim-bench-gpu-") as workdir:
        nodes = []
        if mode in NETOPTIM_MODES:
            for i in range(args.nodes):
                pinned = ("--cpus", format_cpu_list(split.node_cpus[i])) if split.node_cpus else ()
                extra = ("--admin", "127.0.0.1:0", *pinned, *args.node_arg)
                nodes.append(NodeProcess(workdir, name=f"node{i}", threads=split.node_threads, extra_args=extra).start())
        try:
            mode_settings = replace(
                settings,
                nodes=[n.address for n in nodes],
                node_pids=[n.process.pid for n in nodes],
                node_admins=[n.admin_address for n in nodes],
                worker_cpus=split.worker_cpus if mode in NETOPTIM_MODES else (),
            )
            outcome = in_child(train_mode, (mode, config, dtype_name, mode_settings, device), args.timeout_s)
        finally:
            for node in nodes:
                node.stop()
    if "error" in outcome:
        log.error("gpu bench: %s %s %s failed: %s\n%s", size, dtype_name, mode, outcome["error"], outcome.get("traceback", ""))
        return {"status": f"failed: {outcome['error']}"}
    return outcome["ok"]


def _fits(mode: str, params: int, dtype_name: str, gpu_bytes: int) -> str | None:
    per_param = GPU_BYTES_PER_PARAM.get(mode)
    if per_param is None:
        return None
    need = params * per_param[0 if dtype_name == "float32" else 1]
    if need > 0.85 * gpu_bytes:
        return f"skipped: needs about {need / 2**30:.0f} GiB of the GPU's {gpu_bytes / 2**30:.0f} GiB before activations"
    return None


def summarize(entry: dict, params: int, dtype_name: str, limits: dict) -> None:
    """Ratios between the modes of one size and dtype, and each mode's fraction of the offload limit."""
    done = {mode: entry[mode] for mode in MODES if "tokens_per_s" in entry.get(mode, {})}
    for ours, theirs in (("full", "zero2"), ("layerwise", "zero3"), ("full", "zero3"), ("layerwise", "zero2"), ("full", "torch"), ("layerwise", "torch")):
        if ours in done and theirs in done:
            entry[f"{ours}_over_{theirs}_tokens"] = done[ours]["tokens_per_s"] / done[theirs]["tokens_per_s"]
    if "compute" in done and limits:
        bound = offload_limit_step_s(params, DTYPES[dtype_name].itemsize, done["compute"]["step_s"], limits)
        entry["offload_limit"] = bound
        for mode in ("full", "layerwise", "zero2", "zero3"):
            if mode in done:
                entry[f"{mode}_fraction_of_offload_limit"] = bound["offload_limit_step_s"] / done[mode]["step_s"]


def headline(report: dict) -> float | None:
    """full over ZeRO-2 in fp32 at the largest size where both ran (else bf16)."""
    for dtype_name in ("float32", "bfloat16"):
        for size in reversed(list(report["sizes"])):
            value = report["sizes"][size].get(dtype_name, {}).get("full_over_zero2_tokens")
            if value is not None:
                return value
    return None


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (``timeout``, a job scheduler) ends the run as Ctrl-C does: the ``finally`` blocks run,
    so the mode's training process and its nodes are stopped rather than left to train on alone on
    the GPU the next run measures. Only on the main thread, where Python delivers signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> dict:
    with sigterm_unwinds():
        report = _run(args)
    if report.get("sizes"):  # for people, on stderr: stdout is the JSON
        print(table(report), file=sys.stderr)
    return report


def _run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    report: dict = {"benchmark": "gpu", "ratio": None}
    check_node_args(args.node_arg, args.nodes)
    if not torch.cuda.is_available():
        report["status"] = "skipped: torch sees no CUDA device here (a CPU build of torch, or no GPU); no figure"
        _save(report, args.out)
        return report
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    sizes = list(dict.fromkeys(largest_fitting(host_bytes, gpu_bytes) if size == "largest" else size for size in args.sizes))
    too_long = [size for size in sizes if args.seq > SIZES[size].block_size]
    if too_long:
        raise ValueError(f"--seq {args.seq}: the {', '.join(too_long)} model(s) take at most {SIZES[too_long[0]].block_size} tokens per sequence")
    device = torch.device("cuda", 0)
    properties = torch.cuda.get_device_properties(device)
    split = host_split(
        args.nodes,
        args.node_threads,
        args.pin,
        args.worker_cpus,
        pass_thread=node_flag(args.node_arg, "--pass-thread") is not None,
        store_io_threads=store_io_threads(args.node_arg),
    )
    settings = ModeSettings(
        batch=args.batch,
        seq=args.seq,
        warmup=args.warmup,
        steps=args.steps,
        prefetch=args.prefetch,
        keep_for_backward=args.keep_for_backward,
        bucket_numel=args.bucket_numel,
        overlap_forward=args.overlap_forward,
        keep_step_gradients=args.keep_step_gradients,
    )
    report |= {
        "gpu": properties.name,
        "gpu_memory_gb": properties.total_memory / 1e9,
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "shared_memory_huge_pages": shared_huge_pages(),  # the board's pages (page-locked for the GPU's copies)
        "settings": {**asdict(settings), "nodes": args.nodes, "node_args": list(args.node_arg), **split.describe()},
        "sizes": {},
    }
    try:
        import deepspeed

        report["deepspeed"] = deepspeed.__version__
    except ImportError:
        report["deepspeed"] = None
    if args.limits_from:  # measured by an earlier run on this box
        check_same_box(args.limits_from, properties.name, os.cpu_count())
        report["limits"] = args.limits_from
    elif args.limits:
        limits = in_child(measure_limits, (device, args.copy_bytes, args.adam_numel, split, args.bucket_numel), args.timeout_s)
        report["limits"] = limits.get("ok", {"status": limits.get("error")})
    else:
        report["limits"] = {"status": "not measured (--no-limits)"}
    _save(report, args.out)
    jobs = [(size, dtype_name, mode) for size in sizes for dtype_name in args.dtypes for mode in args.modes]
    for size, dtype_name, mode in tqdm(jobs, desc="gpu bench", leave=False):
        params = param_count(SIZES[size])
        entry = report["sizes"].setdefault(size, {"params": params, "config": asdict(SIZES[size])}).setdefault(dtype_name, {})
        skipped = _fits(mode, params, dtype_name, properties.total_memory)
        entry[mode] = {"status": skipped} if skipped else run_mode(mode, size, dtype_name, settings, device, args, split)
        summarize(entry, params, dtype_name, report["limits"] if "pinned_h2d_gbs" in report["limits"] else {})
        report["ratio"] = headline(report)
        _save(report, args.out)
    return report


def _save(report: dict, out: str) -> None:
    """The report so far, for a run cut short (``--out``)."""
    if out:
        Path(out).write_text(json.dumps(report, indent=2))
