"""Train a 3B-parameter GPT for a few steps on one small machine: an out-of-core optimizer node and a
layer-wise worker. One process with ``torch.optim.AdamW`` would need 16 bytes per parameter (48 GB)
for parameters, gradients and moments; here the node keeps its 36 GB of state on disk under a memory
budget and the worker holds a few blocks at a time.

    python -m netoptim.benchmarks.showcase_3b --state-dir /path/on/a/disk/with/40GB --memory-budget 6GiB
    python -m netoptim.benchmarks.showcase_3b --state-dir ... --moments 8bit   # ~18 GB of state

Prints JSON: time per step, loss, peak RSS of node and worker, and the node's disk bytes read and
written per step (from the kernel's accounting of the node process).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gpu_worker.models import GPTConfig
from netoptim.benchmarks.common import vm_bytes

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=27, n_head=24, n_embd=3072)


def proc_io(pid: int) -> dict[str, int]:
    """The kernel's I/O accounting of process ``pid`` (``/proc/PID/io``: ``read_bytes``, ``write_bytes``, ...)."""
    fields = {}
    with open(f"/proc/{pid}/io") as handle:
        for line in handle:
            key, value = line.split(":")
            fields[key] = int(value)
    return fields


def timed_steps(loss_of: Callable[[], torch.Tensor], step: Callable[[], object], steps: int, node_pid: int) -> list[dict]:
    """Train ``steps`` steps (``loss_of()``, its backward, ``step()``), each timed with the node's disk
    bytes read and written meanwhile (the kernel's accounting of process ``node_pid``); each step's
    report is printed as a JSON line as it ends."""
    reports = []
    for _step in range(steps):
        io_before = proc_io(node_pid)
        started = time.perf_counter()
        loss = loss_of()
        loss.backward()
        step()
        elapsed = time.perf_counter() - started
        io_after = proc_io(node_pid)
        reports.append(
            {
                "loss": loss.item(),
                "seconds": elapsed,
                "node_disk_read_gb": (io_after["read_bytes"] - io_before["read_bytes"]) / 1e9,
                "node_disk_written_gb": (io_after["write_bytes"] - io_before["write_bytes"]) / 1e9,
            }
        )
        print(json.dumps(reports[-1]), flush=True)
    return reports


def run_beside_a_node(state_dir: Path, memory_budget: int, worker: Callable[..., None], worker_args: tuple) -> dict:
    """An out-of-core node (``state_dir``, ``memory_budget``) and one spawned process running
    ``worker(node_address, *worker_args, results, node_pid)``, which puts its report on ``results``;
    returns the report with the node's peak RSS and budget added. The node is stopped in any case."""
    from netoptim.launch.processes import NodeProcess

    state_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="netoptim-showcase-") as workdir:
        node = NodeProcess(workdir, extra_args=("--state-dir", str(state_dir), "--memory-budget", str(memory_budget))).start()
        try:
            assert node.process is not None
            context = mp.get_context("spawn")
            results: mp.Queue = context.Queue()
            process = context.Process(target=worker, args=(node.address, *worker_args, results, node.process.pid))
            process.start()
            report = results.get(timeout=3 * 3600)
            process.join()
            report["node_peak_rss_gb"] = vm_bytes("VmHWM", node.process.pid) / 2**30
            report["node_memory_budget_gb"] = memory_budget / 2**30
        finally:
            node.stop()
    return report


def _worker(node: str, config: GPTConfig, steps: int, threads: int, lr: float, moments: str, results: mp.Queue, node_pid: int) -> None:
    from gpu_worker import offload
    from gpu_worker.models import GPT, gpt_initializer
    from netoptim.recipes.stdlib_text import batch_for_step, load_stdlib_bytes

    torch.set_num_threads(threads)
    with torch.device("meta"):
        model = GPT(config)
    params = sum(p.numel() for p in model.parameters())
    started = time.perf_counter()
    opt = offload(model, model.blocks, nodes=[node], init_fn=gpt_initializer(config), lr=lr, timeout_s=1800, push_window_bytes=1 << 30, moments=moments)
    text = load_stdlib_bytes()
    report: dict = {"params": params, "moments": moments, "register_s": time.perf_counter() - started, "steps": []}
    # One batch of Python source, the same at every step: the loss must fall as it is learnt.
    x, y = batch_for_step(text, 0, global_batch=1, block_size=32, rank=0, world_size=1, seed=0)
    # step() returns at once: the update's cost shows in the next forward
    report["steps"] = timed_steps(lambda: model(x, y)[1], opt.step, steps, node_pid)
    report["worker_peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    opt.close()
    results.put(report)


def main(argv: list[str] | None = None) -> int:
    from netoptim.cli.arg_types import size as _size

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-dir", required=True, help="where the node keeps its ~36 GB of state (a local disk)")
    parser.add_argument("--memory-budget", type=_size, default=6 << 30, help="node state in memory at most (default: 6GiB)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the worker (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--n-layer", type=int, default=CONFIG.n_layer, help="blocks (default: %(default)s, 3.06B parameters with the default width)")
    parser.add_argument("--n-embd", type=int, default=CONFIG.n_embd, help="width (default: %(default)s)")
    parser.add_argument(
        "--moments",
        choices=["fp32", "bf16", "8bit"],
        default="fp32",
        help="how the node stores the moments: 12 bytes of state per parameter with fp32 (default), 8 with bf16, about 6 with 8bit",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=args.n_layer, n_head=24, n_embd=args.n_embd)
    report = run_beside_a_node(Path(args.state_dir), args.memory_budget, _worker, (config, args.steps, args.threads, args.lr, args.moments))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
