"""``netoptim bench train``: training throughput and worker memory, netoptim against torch DDP.

For each model size, in one run and with the same number of worker processes, threads per worker,
batch and sequence length:

- ``ddp``: ``DistributedDataParallel`` over gloo with ``torch.optim.AdamW(fused=True)`` on every worker;
- ``full``: netoptim full-model mode (``RemoteAdamW``; every worker holds the model, the nodes the state);
- ``layerwise``: netoptim layer-wise mode (``gpu_worker.offload``; the model is built on the meta
  device and the worker holds the blocks it computes plus ``--prefetch`` more);
- ``compute``: forward and backward alone, no optimizer and no communication: what any mode's step
  costs at least on these workers, the ceiling the others are measured against
  (``*_over_compute_only_tokens``).

Each worker is a fresh process, so its peak RSS (``ru_maxrss``) is its own. Communication hidden
behind compute (layer-wise) is ``1 - blocked / transfer``: ``transfer`` sums, over every unit fetch,
the time from the request to the last byte, ``blocked`` the time the worker actually waited for it.
A mode whose estimated memory does not fit this machine is skipped and says so.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from gpu_worker.models import GPTConfig
from netoptim.benchmarks.common import check_node_args, vm_bytes
from netoptim.benchmarks.gpu.modes import node_status
from transport.host_memory import resident_bytes
from transport.host_threads import cpu_seconds_between, process_cpu_seconds, thread_cpu_seconds
from transport.shm.window import shared_huge_pages

SIZES = {
    "small": GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=256),
    "base": GPTConfig(vocab_size=256, block_size=64, n_layer=12, n_head=12, n_embd=768),
    "1b": GPTConfig(vocab_size=256, block_size=64, n_layer=20, n_head=16, n_embd=2048),
}
MODES = ("compute", "ddp", "full", "layerwise")
LOCAL_MODES = ("compute", "ddp")  # no optimizer node
BYTES_PER_PARAM = {"compute": 8, "ddp": 16, "full": 12, "layerwise": 0}  # per worker: params, grads, Adam moments / send buffers
NODE_BYTES_PER_PARAM = 16  # fp32 params, two moments, a reduction buffer


def param_count(config: GPTConfig) -> int:
    per_block = 12 * config.n_embd**2 + 13 * config.n_embd
    return config.n_layer * per_block + (2 * config.vocab_size + config.block_size + 2) * config.n_embd


def _cpu_s() -> float:
    """CPU seconds this process used, all its threads (compute, and the transport's or gloo's)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _batch(config: GPTConfig, step: int, rank: int, batch: int, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    data = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=generator)
    return data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)


def _worker_device(kind: str, rank: int) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _worker(mode: str, rank: int, world_size: int, config_fields: dict, settings: dict, nodes: list[str], dist_url: str, results: mp.Queue) -> None:
    try:
        results.put(_train(mode, rank, world_size, GPTConfig(**config_fields), settings, nodes, dist_url))
    except BaseException as exc:
        results.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        raise


def _train(mode: str, rank: int, world_size: int, config: GPTConfig, settings: dict, nodes: list[str], dist_url: str) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gpu_worker import RemoteAdamW, offload
    from gpu_worker.models import GPT, gpt_initializer

    torch.set_num_threads(settings["threads"])
    device = _worker_device(settings["device"], rank)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    start_rss = resident_bytes() / 2**20
    options = dict(nodes=nodes, rank=rank, world_size=world_size, lr=1e-4, timeout_s=600, bucket_numel=settings["bucket_numel"])
    if mode == "ddp":
        dist.init_process_group("nccl" if cuda else "gloo", init_method=dist_url, rank=rank, world_size=world_size)
        torch.manual_seed(0)
        model = GPT(config).to(device)
        forward = DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    elif mode == "compute":
        torch.manual_seed(0)
        model = forward = GPT(config).to(device)
        opt = None
    elif mode == "full":
        torch.manual_seed(0)
        model = forward = GPT(config).to(device)
        opt = RemoteAdamW(model.named_parameters(), overlap_forward=settings["overlap_forward"], module=model, **options)
    else:
        torch.manual_seed(0)  # the units' initial values, drawn on rank 0, as the other modes draw theirs
        with torch.device("meta"):
            model = forward = GPT(config)
        opt = offload(
            model,
            model.blocks,
            init_fn=gpt_initializer(config),
            prefetch=settings["prefetch"],
            keep_for_backward=settings["keep_for_backward"],
            device=device,
            **options,
        )
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    step_times, step_call_times, loss = [], [], float("nan")
    waited = transferred = cpu_start = node_cpu_start = 0.0
    fetched = 0
    node_threads_before: list[dict[str, float]] = []
    for step in range(settings["warmup"] + settings["steps"]):
        if step == settings["warmup"]:
            cpu_start = _cpu_s()
            node_cpu_start = sum(process_cpu_seconds(pid) for pid in settings["node_pids"]) if rank == 0 else 0.0
            node_threads_before = [thread_cpu_seconds(pid) for pid in settings["node_pids"]] if rank == 0 else []
            if opt_stats(opt) is not None:
                waited, transferred, fetched = opt_stats(opt).fetch_wait_s, opt_stats(opt).fetch_transfer_s, opt_stats(opt).fetched_bytes
        started = time.perf_counter()
        _logits, loss_tensor = forward(*_batch(config, step, rank, settings["batch"], settings["seq"], device))
        loss_tensor.backward()
        if cuda:
            torch.cuda.synchronize(device)
        stepping = time.perf_counter()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)  # the step's work is done, not only queued
        finished = time.perf_counter()
        loss = loss_tensor.item()
        if step >= settings["warmup"]:
            step_times.append(finished - started)
            step_call_times.append(finished - stepping)
    cpu_per_step = (_cpu_s() - cpu_start) / settings["steps"]
    node_cpu_per_step = (sum(process_cpu_seconds(pid) for pid in settings["node_pids"]) - node_cpu_start) / settings["steps"] if rank == 0 else 0.0
    node_threads = [
        cpu_seconds_between(before, thread_cpu_seconds(pid), settings["steps"]) for pid, before in zip(settings["node_pids"], node_threads_before, strict=False)
    ]
    shared = getattr(opt, "shared_memory_bytes", None)
    stats = opt_stats(opt)
    if mode == "ddp":
        dist.destroy_process_group()
    elif opt is not None:
        opt.close()
    step_s = statistics.median(step_times)
    report = {
        "rank": rank,
        "step_s": step_s,
        "tokens_per_s": settings["batch"] * settings["seq"] / step_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_after_import_mb": start_rss,
        "optimizer_step_s": statistics.median(step_call_times),
        "cpu_s_per_step": cpu_per_step,
        "node_cpu_s_per_step": node_cpu_per_step,
        "node_cpu_s_per_step_by_thread": node_threads,
        "loss": loss,
    }
    if shared is not None:  # payload through same-host shared windows, per step (warm-up steps included)
        report["shared_memory_gb_per_step"] = {key: value / 1e9 / (settings["warmup"] + settings["steps"]) for key, value in shared.items()}
    if cuda:
        report["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    if stats is not None:
        blocked, transfer = stats.fetch_wait_s - waited, stats.fetch_transfer_s - transferred
        report |= {
            "fetch_blocked_s_per_step": blocked / settings["steps"],
            "fetch_transfer_s_per_step": transfer / settings["steps"],
            "comm_hidden_fraction": 1 - blocked / transfer if transfer > 0 else 1.0,
            "fetched_mb_per_step": (stats.fetched_bytes - fetched) / settings["steps"] / 2**20,
            "peak_param_mb": stats.peak_param_bytes / 2**20,
        }
    return report


def opt_stats(opt: object):
    return getattr(opt, "stream_stats", None)


def node_flags(args: argparse.Namespace, state_dir: Path) -> tuple[str, ...]:
    """The flags of one local node: the board switched off, out of core in ``state_dir``, the user's own."""
    flags: tuple[str, ...] = {None: (), True: ("--same-host-board",), False: ("--no-same-host-board",)}[args.same_host_board]
    if args.out_of_core is not None:
        flags += ("--state-dir", str(state_dir), "--memory-budget", str(args.out_of_core))
    return flags + tuple(args.node_arg)


def _run_mode(mode: str, config: GPTConfig, args: argparse.Namespace) -> dict:
    from netoptim.launch.processes import NodeProcess, free_port

    settings = {
        "threads": args.threads,
        "batch": args.batch,
        "seq": min(args.seq, config.block_size),
        "warmup": args.warmup,
        "steps": args.steps,
        "prefetch": args.prefetch,
        "keep_for_backward": args.keep_for_backward,
        "device": args.device,
        "overlap_forward": args.overlap_forward,
        "bucket_numel": args.bucket_numel,
    }
    context = mp.get_context("spawn")
    results: mp.Queue = context.Queue()
    with tempfile.TemporaryDirectory(prefix="netoptim-bench-") as workdir:
        node_processes = (
            []
            if mode in LOCAL_MODES
            else [
                NodeProcess(
                    workdir,
                    name=f"node{i}",
                    threads=args.node_threads,
                    nice=args.node_nice,
                    extra_args=("--admin", "127.0.0.1:0", *node_flags(args, Path(workdir) / f"node{i}-state")),  # the admin: the update path
                ).start()
                for i in range(args.nodes)
            ]
        )
        try:
            nodes = [n.address for n in node_processes]
            settings["node_pids"] = [n.process.pid for n in node_processes if n.process is not None]
            dist_url = f"tcp://127.0.0.1:{free_port()}"
            workers = [
                context.Process(target=_worker, args=(mode, rank, args.workers, asdict(config), settings, nodes, dist_url, results))
                for rank in range(args.workers)
            ]
            for worker in workers:
                worker.start()
            reports = [results.get(timeout=args.timeout_s) for _ in workers]
            for worker in workers:
                worker.join(60)
            node_peak_rss_mb = max((vm_bytes("VmHWM", pid) / 2**20 for pid in settings["node_pids"]), default=0.0)
            update_paths = [status["update_path"] for status in node_status([node.admin_address for node in node_processes])]
        finally:
            for node in node_processes:
                node.stop()
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        raise RuntimeError(f"{mode} workers failed: {errors}")
    reports.sort(key=lambda r: r["rank"])
    summary = {
        "tokens_per_s": args.workers * settings["batch"] * settings["seq"] / max(r["step_s"] for r in reports),  # the slowest worker sets the pace
        "step_s": max(r["step_s"] for r in reports),
        "peak_rss_mb_per_worker": max(r["peak_rss_mb"] for r in reports),
        "rss_after_import_mb": max(r["rss_after_import_mb"] for r in reports),
        "optimizer_step_s": max(r["optimizer_step_s"] for r in reports),
        "worker_cpu_s_per_step": statistics.mean(r["cpu_s_per_step"] for r in reports),
        "loss": reports[0]["loss"],
    }
    if mode not in LOCAL_MODES:
        summary["node_cpu_s_per_step"] = reports[0]["node_cpu_s_per_step"]  # all local nodes, measured by rank 0
        summary["node_cpu_s_per_step_by_thread"] = reports[0]["node_cpu_s_per_step_by_thread"]  # each node's, by OS thread name
        summary["peak_rss_mb_per_node"] = node_peak_rss_mb
        summary["node_update_paths"] = update_paths
        if "shared_memory_gb_per_step" in reports[0]:
            summary["shared_memory_gb_per_step_per_worker"] = {
                key: statistics.mean(r["shared_memory_gb_per_step"][key] for r in reports) for key in ("sent", "received", "board")
            }
    if "peak_gpu_mb" in reports[0]:
        summary["peak_gpu_mb_per_worker"] = max(r["peak_gpu_mb"] for r in reports)
    if "comm_hidden_fraction" in reports[0]:
        summary |= {
            key: statistics.median(r[key] for r in reports)
            for key in ("comm_hidden_fraction", "fetch_blocked_s_per_step", "fetch_transfer_s_per_step", "fetched_mb_per_step", "peak_param_mb")
        }
    if mode == "full":
        summary["overlap_forward"] = args.overlap_forward
        if not args.overlap_forward:  # step() waits for every bucket (overlapped, the waits are in the next forward)
            summary["comm_exposed_s_per_step"] = summary["optimizer_step_s"]
    return summary


def _fits(mode: str, numel: int, args: argparse.Namespace) -> str | None:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need = args.workers * BYTES_PER_PARAM[mode] * numel + (0 if mode in LOCAL_MODES else NODE_BYTES_PER_PARAM * numel)
    if need > 0.8 * ram:
        return f"skipped: needs about {need / 2**30:.0f} GiB of the machine's {ram / 2**30:.0f} GiB"
    return None


def _median_round(summaries: list[dict]) -> dict:
    """One mode's report over the rounds: the round of median tokens/s (the lower of the two middle
    ones for an even count), with every round's tokens/s beside it."""
    if "tokens_per_s" not in summaries[0]:
        return summaries[0]  # skipped: the same reason every round
    rates = [summary["tokens_per_s"] for summary in summaries]
    middle = statistics.median_low(rates)
    return {**summaries[rates.index(middle)], "tokens_per_s_rounds": rates}


def _median_ratio(runs: dict[str, list[dict]], mode: str, baseline: str) -> float:
    """``mode``'s tokens/s over ``baseline``'s, each round's over the same round's, the median of
    those: the ratio of two modes run minutes apart, never of one mode's good round to the other's bad."""
    return statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[mode], runs[baseline], strict=True))


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    check_node_args(args.node_arg, args.nodes, own_directories="--out-of-core BUDGET")
    report: dict = {
        "benchmark": "train",
        "workers": args.workers,
        "nodes": args.nodes,
        "threads_per_worker": args.threads,
        "batch": args.batch,
        "seq": args.seq,
        "device": args.device,
        "same_host_board": args.same_host_board if args.same_host_board is not None else args.out_of_core is None,
        "node_memory_budget": args.out_of_core,  # None: in memory
        "node_args": list(args.node_arg),
        "node_nice": args.node_nice,
        # the host's policy: "never" leaves the board in 4 KiB pages, which layer-wise workers fault in again every step
        "shared_memory_huge_pages": shared_huge_pages(),
    }
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device here (a CPU build of torch, or no GPU); use --device cpu")
        report["gpu"] = torch.cuda.get_device_name(0)
        if args.workers > torch.cuda.device_count():
            raise ValueError(
                f"--device cuda: {args.workers} workers but {torch.cuda.device_count()} GPU(s); NCCL runs one rank per GPU: pass --workers {torch.cuda.device_count()}"
            )
    report["sizes"] = {}
    report["rounds"] = args.rounds
    ratio = None
    # Round after round of every mode, so a slow spell of the machine falls on all modes alike.
    jobs = [(size, mode) for _round in range(args.rounds) for size in args.sizes for mode in MODES]
    runs: dict[str, dict[str, list[dict]]] = {size: {mode: [] for mode in MODES} for size in args.sizes}
    for size, mode in tqdm(jobs, desc="train bench", leave=False):
        config = SIZES[size]
        entry = report["sizes"].setdefault(size, {"params": param_count(config), "config": asdict(config)})
        skipped = _fits(mode, entry["params"], args)
        runs[size][mode].append({"status": skipped} if skipped else _run_mode(mode, config, args))
    for size in args.sizes:
        entry = report["sizes"][size]
        for mode, summaries in runs[size].items():
            entry[mode] = _median_round(summaries)
        if "tokens_per_s" in entry["ddp"] and "tokens_per_s" in entry["layerwise"]:
            entry["layerwise_over_ddp_tokens"] = _median_ratio(runs[size], "layerwise", "ddp")
            entry["layerwise_over_ddp_peak_rss"] = entry["layerwise"]["peak_rss_mb_per_worker"] / entry["ddp"]["peak_rss_mb_per_worker"]
            above = {mode: entry[mode]["peak_rss_mb_per_worker"] - entry[mode]["rss_after_import_mb"] for mode in ("ddp", "layerwise")}
            entry["layerwise_over_ddp_peak_rss_above_import"] = above["layerwise"] / above["ddp"]  # what the model and training add
            if "peak_gpu_mb_per_worker" in entry["ddp"]:
                entry["layerwise_over_ddp_peak_gpu"] = entry["layerwise"]["peak_gpu_mb_per_worker"] / entry["ddp"]["peak_gpu_mb_per_worker"]
            if "tokens_per_s" in entry["full"]:
                entry["full_over_ddp_tokens"] = _median_ratio(runs[size], "full", "ddp")
            if "tokens_per_s" in entry["compute"]:  # how near each mode comes to forward and backward alone
                for mode in ("ddp", "full", "layerwise"):
                    if "tokens_per_s" in entry[mode]:
                        entry[f"{mode}_over_compute_only_tokens"] = _median_ratio(runs[size], mode, "compute")
            ratio = entry["layerwise_over_ddp_tokens"]  # the largest size both ran
    report["ratio"] = ratio
    return report
