"""The measurements behind ``netoptim plan``: blocks, the loopback link, a node group's update."""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from gpu_worker.models.gpt import GPT, GPTConfig
from gpu_worker.pipeline.balance import BlockCost
from gpu_worker.pipeline.blocks import pipeline_blocks
from gpu_worker.pipeline.partition import calibrate
from gpu_worker.remote_adamw import RemoteAdamW
from netoptim.planning.planner import OptimizerCost, PlanCalibration


def measure_blocks(
    model: torch.nn.Module, sample_for: Callable[[int], torch.Tensor], micro_sizes: Sequence[int], *, repeats: int = 3
) -> dict[int, list[BlockCost]]:
    """Each block of ``model`` at every micro-batch size (``sample_for(size)`` gives the inputs)."""
    blocks = pipeline_blocks(model)
    return {size: calibrate(blocks, sample_for(size), repeats=repeats) for size in sorted(set(micro_sizes))}


def measure_link(*, large_bytes: int = 8 << 20, repeats: int = 5) -> tuple[float, float]:
    """Loopback TCP: one-way latency of a small message (half a round trip) and bytes/s of a large one."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while True:
                header = _recv_exact(conn, 8)
                if not header:
                    return
                size = int.from_bytes(header, "little")
                _recv_exact(conn, size)
                conn.sendall(b"k")

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    payload = bytes(large_bytes)
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def round_trip(data: bytes) -> float:
            started = time.perf_counter()
            client.sendall(len(data).to_bytes(8, "little") + data)
            _recv_exact(client, 1)
            return time.perf_counter() - started

        small = statistics.median(round_trip(b"x" * 64) for _ in range(20 * repeats))
        large = statistics.median(round_trip(payload) for _ in range(repeats))
    thread.join(timeout=5)
    server.close()
    latency = small / 2
    return latency, large_bytes / max(large - small, 1e-9)


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            return b""
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def measure_optimizer(
    start_node: Callable[[], AbstractContextManager[tuple[str, int]]],
    replicas: int,
    layouts: Sequence[Callable[[], list[dict[str, Any]]]],
    *,
    steps: int = 9,
) -> OptimizerCost:
    """Time ``steps`` updates through a fresh node (``start_node`` yields its address and process id)
    for each layout (a factory of param groups), ``replicas`` workers (threads) pushing; fit
    ``intercept + per_param * numel`` to the wall time, to the CPU time of workers and node, and to
    the node's own CPU time (what a node on a machine of its own spends)."""
    points = []
    for make_groups in layouts:
        with start_node() as (address, pid):
            numel = sum(p.numel() for group in make_groups() for p in _tensors(group["params"]))
            points.append((numel, *_time_updates(address, pid, replicas, make_groups, steps)))
    (n0, wall0, cpu0, node0), (n1, wall1, cpu1, node1) = points[0], points[-1]
    intercept, per_param = _line(n0, wall0, n1, wall1)
    cpu_intercept, cpu_per_param = _line(n0, cpu0, n1, cpu1)
    node_intercept, node_per_param = _line(n0, node0, n1, node1)
    return OptimizerCost(intercept, per_param, cpu_intercept, cpu_per_param, node_intercept, node_per_param)


def _line(n0: int, t0: float, n1: int, t1: float) -> tuple[float, float]:
    """Intercept and slope through two points; where noise makes the slope meaningless (small
    models), proportional through the larger point instead."""
    slope = (t1 - t0) / (n1 - n0) if n1 != n0 else 0.0
    intercept = t0 - slope * n0
    if slope <= 0 or intercept < 0:
        return 0.0, t1 / n1
    return intercept, slope


def _tensors(params: Sequence[Any]) -> list[torch.Tensor]:
    return [p[1] if isinstance(p, tuple) else p for p in params]


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _time_updates(address: str, node_pid: int, replicas: int, make_groups: Callable[[], list[dict[str, Any]]], steps: int) -> tuple[float, float, float]:
    """Median wall seconds of a step; mean CPU seconds per step of the workers plus the node, and of the node alone."""
    times: list[float] = []
    cpu: list[float] = []
    node_cpu: list[float] = []
    barrier = threading.Barrier(replicas)
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            groups = make_groups()
            opt = RemoteAdamW(groups, lr=1e-3, nodes=[address], rank=rank, world_size=replicas, timeout_s=120)
            generator = torch.Generator().manual_seed(rank)
            for param in (p for group in groups for p in _tensors(group["params"])):
                param.grad = torch.randn(param.shape, generator=generator)
            for step in range(steps + 1):
                barrier.wait()
                started, node_started = time.perf_counter(), _process_cpu_s(node_pid)
                cpu_started = time.process_time() + node_started
                opt.step()
                barrier.wait()  # every replica done: the step's CPU is all spent
                if rank == 0 and step:  # the first step is a warm-up
                    times.append(time.perf_counter() - started)
                    node_now = _process_cpu_s(node_pid)
                    cpu.append(time.process_time() + node_now - cpu_started)
                    node_cpu.append(node_now - node_started)
            opt.close()
        except BaseException as exc:  # reported by the caller
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(replicas)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    # CPU time as means: the node's is read in clock ticks (10 ms), coarser than a small step; the
    # mean of the ticked deltas is unbiased where their median is not
    return statistics.median(times), statistics.fmean(cpu), statistics.fmean(node_cpu)


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the calibration as the ranks run, with their number of torch threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def calibrate_gpt(
    config: GPTConfig,
    *,
    seq_len: int,
    micro_sizes: Sequence[int],
    replicas: Sequence[int],
    start_node: Callable[[], AbstractContextManager[tuple[str, int]]],
    param_groups: Callable[[list[tuple[str, torch.nn.Parameter]]], list[dict[str, Any]]],
    threads_per_rank: int = 1,
    cores: float | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> PlanCalibration:
    """Measure a GPT of ``config`` for :func:`~netoptim.planning.planner.plan`: its blocks at every
    micro-batch size, the loopback link, and a node group's update for every replica count (on nodes
    from ``start_node``, a context manager yielding a fresh node's address)."""
    with torch_threads(threads_per_rank):
        torch.manual_seed(0)
        model = GPT(config)
        progress("blocks")
        tokens = torch.Generator().manual_seed(0)
        block_costs = measure_blocks(model, lambda size: torch.randint(0, config.vocab_size, (size, seq_len), generator=tokens), micro_sizes)
        progress("link")
        latency, bandwidth = measure_link()
        optimizer = {}
        half = GPT(GPTConfig(**{**asdict(config), "n_layer": max(1, config.n_layer // 2)}))
        # every worker thread its own copy of the parameters (each writes the new values into them)
        layouts = [lambda: param_groups(list(copy.deepcopy(half).named_parameters())), lambda: param_groups(list(copy.deepcopy(model).named_parameters()))]
        for count in sorted(set(replicas)):
            progress(f"optimizer, {count} replica(s)")
            optimizer[count] = measure_optimizer(start_node, count, layouts)
            progress(f"optimizer, {count} replica(s): {optimizer[count]}")
    return PlanCalibration(
        block_costs=block_costs,
        link_latency_s=latency,
        link_bytes_per_s=bandwidth,
        optimizer=optimizer,
        cores=float(cores or os.cpu_count() or 1),
        model=asdict(config),
    )  # the runtime's parameters come from real runs (netoptim plan's measure_runtime_overhead)
