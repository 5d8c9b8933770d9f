"""The compiled update keeps to the threads the node was given (``netoptim node --threads``): numba's
OpenMP pool, started by the first update of a thread, sets that thread's OpenMP count to every CPU
numba may use, which torch then reports (and its ops, and the loop's next plan, use). Each case runs
in a fresh interpreter, where the pool has not started yet."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROGRAM = r"""
import json, sys, threading
import torch
torch.set_num_threads(int(sys.argv[1]))
from protos.job.hyper import AdamWHyper
from optimizer_node.update.kernels import compiled_update
from optimizer_node.update.reduce import OrderedReduction
from optimizer_node.update.bucket_pass import reduce_and_update

assert compiled_update.usable()


def update_once() -> dict:
    numel = 1 << 20
    param, exp_avg, exp_avg_sq, step = torch.randn(numel), torch.zeros(numel), torch.zeros(numel), torch.zeros(())
    reduction = OrderedReduction(numel, 2, lambda: torch.empty(numel), defer=True)
    for rank in range(2):
        reduction.add(rank, [(0, torch.randn(numel))])
    hyper = AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.01)
    compiled = reduce_and_update(reduction, param, exp_avg, exp_avg_sq, step, hyper, grad_divisor=torch.tensor(2.0))
    return {"compiled": compiled, "torch_threads": torch.get_num_threads(), "loop_threads": compiled_update.loop_threads()}


main = update_once()
beside = {}
thread = threading.Thread(target=lambda: beside.update(update_once()))  # a pass thread's first update
thread.start()
thread.join()
print(json.dumps({"main": main, "thread": beside, "numba_threads": compiled_update._numba_threads()}))
"""


def run(threads: int) -> dict:
    env = {**os.environ}
    env.pop("OMP_NUM_THREADS", None)
    env.pop("NUMBA_NUM_THREADS", None)
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(threads)], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="numba's pool is one thread on one CPU: the count it sets is the node's")
def test_one_update_thread_stays_one_after_numba_s_pool_started():
    result = run(1)
    assert result["numba_threads"] >= 2, result
    for where in ("main", "thread"):
        assert result[where]["compiled"], result
        assert result[where]["torch_threads"] == 1 and result[where]["loop_threads"] == 1, result


def test_every_cpu_when_asked_for():
    cpus = len(os.sched_getaffinity(0))
    result = run(cpus)
    for where in ("main", "thread"):
        assert result[where]["compiled"], result
        assert result[where]["torch_threads"] == cpus and result[where]["loop_threads"] == min(cpus, result["numba_threads"]), result
