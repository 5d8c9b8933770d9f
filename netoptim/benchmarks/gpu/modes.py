"""One mode of ``netoptim bench gpu`` trained in this process: the same GPT, batches and timing for
torch alone, netoptim (full model and layer-wise) and DeepSpeed ZeRO-2/ZeRO-3 with CPU offload.

:func:`train_mode` runs on whatever device it is given, so the netoptim and torch modes are tested
on the CPU; the benchmark itself runs them on a GPU, each mode in a fresh process.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field

import torch

from gpu_worker.models import GPT, GPTConfig, gpt_initializer
from netoptim.benchmarks.common import vm_bytes
from netoptim.benchmarks.gpu.mode_names import DEEPSPEED_MODES, MODES
from netoptim.launch.host_cpus import format_cpu_list, run_on
from netoptim.launch.processes import free_port
from protos.job.placement import DEFAULT_BUCKET_NUMEL
from transport.host_threads import cpu_seconds_between, thread_cpu_seconds

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LR, WEIGHT_DECAY = 1e-4, 0.01


@dataclass
class ModeSettings:
    """What every mode of one run shares, so that their figures compare."""

    batch: int = 16
    seq: int = 64
    warmup: int = 3  # a node times its update paths from each bucket's third update on
    steps: int = 5
    prefetch: int = 2
    keep_for_backward: int = 0  # layer-wise: offload(keep_for_backward=...), bytes
    bucket_numel: int = DEFAULT_BUCKET_NUMEL
    overlap_forward: bool = True  # full model: the next forward waits per module (RemoteAdamW(overlap_forward=True))
    keep_step_gradients: bool = True  # full model: RemoteAdamW(keep_step_gradients=...)
    nodes: list[str] = field(default_factory=list)
    node_pids: list[int] = field(default_factory=list)
    node_admins: list[str] = field(default_factory=list)
    worker_cpus: tuple[int, ...] = ()  # where the training process runs (``--pin``); empty: anywhere


def node_status(admins: list[str], *, settle_s: float = 0.0) -> list[dict]:
    """Each local node's update path and last step's phases (its admin service); with ``settle_s``,
    first wait up to that long for every node's compiled update loop to be checked and in use, so
    the timed steps do not measure a node's first seconds."""
    import grpc

    from protos import admin_pb2, admin_pb2_grpc

    statuses = []
    for address in admins:
        with grpc.insecure_channel(address) as channel:
            stub = admin_pb2_grpc.OptimizerNodeAdminStub(channel)
            deadline = time.monotonic() + settle_s
            while True:
                status = stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
                if "checking" not in status.update_path or time.monotonic() >= deadline:  # settled one way or the other
                    break
                time.sleep(0.2)
            last = status.last_step
            statuses.append(
                {
                    "update_path": status.update_path,
                    "last_step_s": {
                        "wall": last.wall_seconds,
                        "tail": last.tail_seconds,  # after the last gradient: the node's share of the step's critical path
                        "reduce": last.reduce_seconds,
                        "update": last.update_seconds,
                        "send": last.send_seconds,
                    },
                    # of "update", inside the passes; each bucket's pass (a long tail: threads stalled at the pass's join)
                    "last_step_passes": {
                        "seconds": last.pass_seconds,
                        "buckets": last.buckets,
                        "median_ms": last.pass_median_ms,
                        "p90_ms": last.pass_p90_ms,
                        "max_ms": last.pass_max_ms,
                    },
                }
            )
    return statuses


def batch_for(config: GPTConfig, step: int, settings: ModeSettings, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s tokens: the same in every mode (drawn on the CPU from a seed)."""
    generator = torch.Generator().manual_seed(7919 + step)
    data = torch.randint(0, config.vocab_size, (settings.batch, settings.seq + 1), generator=generator)
    return data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)


def peak_rss_mb(pids: list[int]) -> tuple[float, float]:
    """Peak resident memory of this process and the sum over the processes ``pids`` (the local nodes),
    MiB. Pages that several of them map (same-host windows, the parameter board) count in each."""
    nodes = sum(vm_bytes("VmHWM", pid) for pid in pids) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, nodes


def host_pss_mb(pids: list[int]) -> float:
    """Proportional resident memory now of this process plus ``pids``, MiB: pages shared between them
    (a node's and its worker's shared windows) count once in all, where peak RSS counts them in each."""
    total = 0.0
    for pid in ["self", *pids]:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) / 1024
    return total


def _deepspeed_engine(mode: str, model: torch.nn.Module, dtype: torch.dtype, settings: ModeSettings):
    try:
        import deepspeed
    except ImportError as exc:
        raise RuntimeError("DeepSpeed is not installed: pip install 'netoptim-train[bench]' (its CPU Adam op builds on first use)") from exc
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    zero: dict = {"stage": 2 if mode == "zero2" else 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if mode == "zero3":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    else:
        zero |= {"overlap_comm": True, "contiguous_gradients": True}
    config = {
        "train_micro_batch_size_per_gpu": settings.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)
    engine, _opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train_mode(mode: str, config: GPTConfig, dtype_name: str, settings: ModeSettings, device: torch.device) -> dict:
    """Train ``mode`` for ``settings.warmup + settings.steps`` steps; return its figures.

    The step time is the wall time of the timed steps over their number, the device synchronized at
    both ends: layer-wise work that spills into the next step's forward counts where it happens.
    """
    from gpu_worker import RemoteAdamW, offload

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    dtype = DTYPES[dtype_name]
    if settings.worker_cpus:
        run_on(settings.worker_cpus)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    options = dict(
        nodes=settings.nodes, rank=0, world_size=1, lr=LR, weight_decay=WEIGHT_DECAY, timeout_s=600, wire_dtype=dtype, bucket_numel=settings.bucket_numel
    )
    torch.manual_seed(0)
    started_init = time.perf_counter()
    opt = engine = None
    if mode == "layerwise":
        with torch.device("meta"):
            model = GPT(config).to(dtype)
        opt = offload(
            model,
            model.blocks,
            init_fn=gpt_initializer(config),
            prefetch=settings.prefetch,
            keep_for_backward=settings.keep_for_backward,
            device=device,
            **options,
        )
    elif mode in DEEPSPEED_MODES:
        with torch.device(device):
            model = GPT(config)  # DeepSpeed casts to bf16 itself and keeps the fp32 master on the CPU
        engine = _deepspeed_engine(mode, model, dtype, settings)
    else:
        with torch.device(device):
            model = GPT(config).to(dtype)
        if mode == "torch":
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        elif mode == "full":
            opt = RemoteAdamW(
                model.named_parameters(),
                push_during_backward=True,
                overlap_forward=settings.overlap_forward,
                keep_step_gradients=settings.keep_step_gradients,
                module=model,
                **options,
            )
    init_s = time.perf_counter() - started_init
    forward = engine if engine is not None else model
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    stats = getattr(opt, "stream_stats", None)
    session = getattr(opt, "_session", None)  # netoptim: the worker's time per phase
    loss = torch.zeros(())
    timed_from = waited = transferred = 0.0
    fetched = 0
    shared_before: dict[str, int] = {}
    copied_before: dict[str, int] = {}
    threads_before: dict[int, dict[str, float]] = {}
    for step in range(settings.warmup + settings.steps):
        if step == settings.warmup:
            if cuda:
                torch.cuda.synchronize(device)
            timed_from = time.perf_counter()
            if stats is not None:
                waited, transferred, fetched = stats.fetch_wait_s, stats.fetch_transfer_s, stats.fetched_bytes
            if settings.node_admins:
                node_status(settings.node_admins, settle_s=120.0)
            threads_before = {pid: thread_cpu_seconds(pid) for pid in (os.getpid(), *settings.node_pids)}
            if session is not None:
                session.take_timings()
                shared_before = session.shared_memory_bytes
                copied_before = opt.device_copy_bytes
        _logits, loss = forward(*batch_for(config, step, settings, device))
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize(device)
    step_s = (time.perf_counter() - timed_from) / settings.steps
    threads_spent = {pid: cpu_seconds_between(before, thread_cpu_seconds(pid), settings.steps) for pid, before in threads_before.items()}
    pss_mb, peak_rss = host_pss_mb(settings.node_pids), peak_rss_mb(settings.node_pids)
    report = {
        "step_s": step_s,
        "tokens_per_s": settings.batch * settings.seq / step_s,
        "init_s": init_s,
        "loss": float(loss.detach().float().item()),
        "peak_host_rss_mb": sum(peak_rss),
        "peak_rss_mb_worker": peak_rss[0],
        "peak_rss_mb_nodes": peak_rss[1],
        "host_pss_mb_after_training": pss_mb,
        "worker_cpus": format_cpu_list(os.sched_getaffinity(0)),  # where each process ran: --pin's sets, or all
        "node_cpus": [format_cpu_list(os.sched_getaffinity(pid)) for pid in settings.node_pids],
        # CPU seconds a timed step by OS thread name ("main": the training loop, a node's serve loop;
        # the process's own name: threads that kept it, such as torch's and numba's compute threads)
        "worker_cpu_s_per_step_by_thread": threads_spent.get(os.getpid(), {}),
        "node_cpu_s_per_step_by_thread": [threads_spent[pid] for pid in settings.node_pids if pid in threads_spent],
    }
    if cuda:
        report["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    if session is not None:
        phases = session.take_timings()
        report["worker_phases_s_per_step"] = {name: getattr(phases, name) / settings.steps for name in ("gather_s", "send_s", "wait_s", "install_s")}
        # what went through same-host shared memory rather than a socket: sent (gradients; in place:
        # gathered straight into the node's window), received (parameters; board: read off the node's board)
        shared = session.shared_memory_bytes
        report["shared_memory_mb_per_step"] = {key: (shared[key] - shared_before.get(key, 0)) / settings.steps / 2**20 for key in shared}
        # parameters copied up to the GPU: straight from page-locked windows and boards, or staged (a CPU copy first)
        copied = opt.device_copy_bytes
        report["host_to_device_mb_per_step"] = {key: (copied[key] - copied_before.get(key, 0)) / settings.steps / 2**20 for key in copied}
    if settings.node_admins:
        report["nodes"] = node_status(settings.node_admins)
    if stats is not None:
        blocked, transfer = stats.fetch_wait_s - waited, stats.fetch_transfer_s - transferred
        report["comm_hidden_fraction"] = 1 - blocked / transfer if transfer > 0 else 1.0
        report["fetched_mb_per_step"] = (stats.fetched_bytes - fetched) / settings.steps / 2**20
    if opt is not None and hasattr(opt, "close"):
        opt.close()
    return report
