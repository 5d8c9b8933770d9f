"""``netoptim bench step``: what a bucket costs, and where a step's time goes, on the worker and on the node.

One ``netoptim node`` process and one worker (this process), one torch thread each, train one fp32
parameter of ``--numel`` elements split into buckets of several sizes (``--buckets``: how many). A
step is one full-model step of the worker session: gather every bucket's gradient into a send
buffer, push it, wait, install the new values as they come. The data moved is the same whatever the
bucket count, so what grows with the count is the per-bucket work. The baseline is the same run
with the fewest buckets, and ``ratio`` is its step time over the step time with the most (1.0: a
bucket costs nothing).

Per bucket count the report gives the median step and, from the same steps, each phase on the
worker (gather, send, wait, install; what the worker spends outside them is "other") and on the
node (reduce, update, send, read through its admin service), the marginal cost of one bucket against
the fewest buckets (milliseconds per bucket per step), the send buffers allocated after warm-up
(none is the goal), the node's update path after the timed steps (timing starts once its compiled loop is checked: the
torch ops it uses meanwhile are its first seconds, not its steady state), and the install rate against a ``copy_`` between two buffers of the same size
on the same thread count (``install_vs_memcpy``; a buffer of ``--numel`` may sit in the caches) and
against the machine's memcpy bandwidth, 256 MiB buffers on every core (``install_vs_machine_memcpy``).
``--wire-dtype bfloat16`` sends bf16 each way (the node casts its new values as it computes them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import grpc
import torch
from tqdm import tqdm

from gpu_worker.links.liveness import WorkerTimeouts
from gpu_worker.session import OffloadSession
from netoptim.launch.processes import NodeProcess
from optimizer_node.update.adamw import AdamWHyper
from protos import admin_pb2, admin_pb2_grpc
from protos.job.placement import ParamSpec
from protos.job.spec import JobSpec
from transport.host_threads import cpu_seconds_between, thread_cpu_seconds

HYPER = AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.01)


def memcpy_gbs(numel: int, repeats: int = 5, threads: int | None = None) -> float:
    """GB/s of ``copy_`` between two fp32 buffers of ``numel`` elements (bytes read + written), on
    ``threads`` torch threads (default: as set)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        source, target = torch.ones(numel), torch.empty(numel)
        target.copy_(source)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            target.copy_(source)
            times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(before)
    return 2 * numel * 4 / statistics.median(times) / 1e9


MACHINE_MEMCPY_NUMEL = 64 << 20
"""256 MiB a buffer: well beyond the caches, so the copy runs at the memory's speed."""


def node_timings(stub: admin_pb2_grpc.OptimizerNodeAdminStub) -> dict[str, float]:
    last = stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=10).last_step
    return {
        "wall_s": last.wall_seconds,
        "tail_s": last.tail_seconds,  # the last gradient in -> the last bucket out
        "reduce_s": last.reduce_seconds,
        "update_s": last.update_seconds,
        "pass_s": last.pass_seconds,  # of update_s: inside the update passes
        "send_s": last.send_seconds,
    }


def settled_update_path(stub: admin_pb2_grpc.OptimizerNodeAdminStub, timeout_s: float = 180.0) -> str:
    """The node's update path once its first seconds are over: a node updates with torch ops while it
    checks its compiled loop in the background, and a step timed then measures the start-up."""
    deadline = time.monotonic() + timeout_s
    while True:
        path = stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=10).update_path
        if "checking" not in path or time.monotonic() > deadline:
            return path
        time.sleep(0.1)


def measure(numel: int, buckets: int, steps: int, warmup: int, wire_dtype: str = "float32", node_args: tuple[str, ...] = ()) -> dict:
    """Median step time and phases of one worker training ``numel`` parameters in ``buckets`` buckets,
    ``wire_dtype`` on the wire; ``node_args``: flags for the node besides the benchmark's."""
    bucket_numel = -(-numel // buckets)
    job = JobSpec(
        world_size=1, num_nodes=1, bucket_numel=bucket_numel, wire_dtype=wire_dtype, max_grad_norm=None, params=(ParamSpec("w", (numel,), "float32", 0),)
    )
    param = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 1e-3
    with (
        tempfile.TemporaryDirectory(prefix="netoptim-bench-step-") as workdir,
        NodeProcess(workdir, threads=1, extra_args=("--admin", "127.0.0.1:0", *node_args)) as node,
    ):
        session = OffloadSession([node.address], job, 0, [param], timeouts=WorkerTimeouts())
        channel = grpc.insecure_channel(node.admin_address)
        stub = admin_pb2_grpc.OptimizerNodeAdminStub(channel)
        try:
            session.connect()
            rows = []
            allocated_before = 0
            threads_before: dict[str, float] = {}
            shared_before: dict[str, int] = {}
            for index in tqdm(range(warmup + steps), desc=f"{len(session.buckets)} buckets", leave=False):
                if index == warmup:
                    settled_update_path(stub)  # the first update started the check
                    allocated_before = session.send_buffers_allocated
                    threads_before = thread_cpu_seconds(node.process.pid)
                    shared_before = session.shared_memory_bytes
                session.take_timings()
                started = time.perf_counter()
                session.finish_step([grad], [HYPER])
                wall = time.perf_counter() - started
                if index >= warmup:
                    rows.append((wall, session.take_timings(), node_timings(stub)))
            allocated_after_warmup = session.send_buffers_allocated - allocated_before
            update_path = stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=10).update_path  # the choice the timed steps led to
            node_threads = cpu_seconds_between(threads_before, thread_cpu_seconds(node.process.pid), steps)
            shared = {key: round((value - shared_before.get(key, 0)) / steps / 2**20, 1) for key, value in session.shared_memory_bytes.items()}
        finally:
            session.close()
            channel.close()
    median_index = sorted(range(len(rows)), key=lambda i: rows[i][0])[len(rows) // 2]
    wall, worker, node = rows[median_index]
    phases = {name: round(getattr(worker, name), 4) for name in ("gather_s", "send_s", "wait_s", "install_s")}
    phases["other_s"] = round(wall - sum(phases.values()), 4)
    return {
        "buckets": len(session.buckets),
        "bucket_numel": bucket_numel,
        "node_update_path": update_path,
        "step_s": round(statistics.median(row[0] for row in rows), 4),
        "worker": phases,
        "node": {name: round(value, 4) for name, value in node.items()},
        "node_cpu_s_per_step_by_thread": node_threads,  # the mean of the timed steps, by OS thread name ("main": the serve loop)
        # MiB a step through same-host shared memory, of the step's 2 x 4 x numel bytes (the rest on the socket)
        "shared_memory_mb_per_step": shared,
        "install_gbs": round(2 * numel * 4 / worker.install_s / 1e9, 2) if worker.install_s > 0 else None,
        "send_buffers_allocated_after_warmup": allocated_after_warmup,
    }


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    counts = sorted(set(args.buckets))
    results = [measure(args.numel, count, args.steps, args.warmup, args.wire_dtype, tuple(args.node_arg)) for count in counts]
    fewest, most = results[0], results[-1]
    for result in results[1:]:
        extra = result["buckets"] - fewest["buckets"]
        result["ms_per_bucket"] = round(1e3 * (result["step_s"] - fewest["step_s"]) / extra, 4)
    memcpy = memcpy_gbs(args.numel)
    machine_memcpy = memcpy_gbs(MACHINE_MEMCPY_NUMEL, threads=os.cpu_count() or 1)
    for result in results:
        result["install_vs_memcpy"] = round(result["install_gbs"] / memcpy, 3) if result["install_gbs"] else None
        result["install_vs_machine_memcpy"] = round(result["install_gbs"] / machine_memcpy, 3) if result["install_gbs"] else None
    return {
        "benchmark": "step",
        "ratio": round(fewest["step_s"] / most["step_s"], 3),
        "numel": args.numel,
        "threads": args.threads,
        "wire_dtype": args.wire_dtype,
        "node_args": list(args.node_arg),
        "steps": args.steps,
        "memcpy_gbs": round(memcpy, 2),
        "machine_memcpy_gbs": round(machine_memcpy, 2),
        "max_ms_per_bucket": max((r["ms_per_bucket"] for r in results[1:]), default=None),
        "results": results,
    }
