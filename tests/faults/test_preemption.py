"""Preemption drill: an elastic job (processes, a real node, membership through a TCPStore) loses a
worker to SIGTERM in the middle of a step and gains a new one; it finishes every step exactly once,
and its parameters are bitwise those of torch's AdamW fed each step's average at that step's width."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from gpu_worker.elastic import ElasticGroup
from netoptim.benchmarks.morph_bench import reference

pytestmark = pytest.mark.faults

REPO = Path(__file__).resolve().parents[2]
STEPS = 24


def wait_progress(store: torch.distributed.TCPStore, step: int, members: list[subprocess.Popen], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.check(["drill/progress"]) and int(store.get("drill/progress")) >= step:
            return
        if any(p.poll() not in (None, 0) for p in members):
            raise AssertionError("a member failed")
        time.sleep(0.02)
    raise AssertionError(f"the job did not reach step {step} in {timeout_s} s")


def test_a_preempted_worker_leaves_mid_step_and_a_new_one_joins_without_a_lost_or_repeated_step(start_node, tmp_path):
    node = start_node()
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ElasticGroup.create(store, ["w0", "w1", "w2"])

    def member(name: str, *extra: str) -> subprocess.Popen:
        command = [sys.executable, "-m", "tests.faults.elastic_program", "--node", node.address, "--store", f"127.0.0.1:{store.port}"]
        command += ["--name", name, "--steps", str(STEPS), "--step-delay", "0.05", "--out", str(tmp_path), *extra]
        return subprocess.Popen(command, cwd=REPO, stdout=(tmp_path / f"{name}.log").open("wb"), stderr=subprocess.STDOUT)

    members = {name: member(name) for name in ("w0", "w1", "w2")}
    members["w3"] = member("w3", "--join")  # waits for drill/join
    wait_progress(store, 3, list(members.values()))
    members["w2"].send_signal(signal.SIGTERM)  # in its step: the 50 ms of work is most of one
    wait_progress(store, 7, list(members.values()))
    store.set("drill/join", "1")
    for name, process in members.items():
        assert process.wait(120) == 0, (name, (tmp_path / f"{name}.log").read_text()[-3000:])
    logs = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in members}
    assert logs["w2"]["left_at"] is not None and 3 <= logs["w2"]["left_at"] < STEPS
    widths: dict[int, int] = {}
    for step in range(STEPS):  # every step trained once, by as many distinct ranks as its width
        ranks = sorted(entry[0] for log in logs.values() for s, entry in log["steps"].items() if int(s) == step)
        world = {entry[1] for log in logs.values() for s, entry in log["steps"].items() if int(s) == step}
        assert len(world) == 1 and ranks == list(range(next(iter(world)))), (step, ranks, world)
        widths[step] = next(iter(world))
    assert widths[0] == 3 and 2 in widths.values() and widths[STEPS - 1] == 3  # shrank, then grew back
    final = torch.load(tmp_path / "final.pt")
    assert all(torch.equal(a, b) for a, b in zip(final, reference(widths, STEPS), strict=True))
