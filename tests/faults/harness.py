"""Running a small job as real processes (a node, worker processes) and killing them on purpose."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from netoptim.launcher import NodeProcess

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
WORLD = 2
TRIALS = int(os.environ.get("NETOPTIM_FAULT_TRIALS", "1"))
"""Seeded trials per case; CI runs a few, ``NETOPTIM_FAULT_TRIALS=20`` the full drill."""


@dataclass
class Job:
    """One node and its workers, started in ``workdir``; every process is stopped by :meth:`close`."""

    workdir: Path
    mode: str = "full"
    node_args: tuple[str, ...] = ()
    worker_timeout_s: float = 60.0
    node: NodeProcess | None = None
    workers: dict[int, subprocess.Popen] = field(default_factory=dict)
    launches: int = 0

    @property
    def out(self) -> Path:
        return self.workdir / "final.pt"

    def start_node(self, name: str = "node", extra: tuple[str, ...] = ()) -> NodeProcess:
        self.node = NodeProcess(self.workdir, name=name, extra_args=(*self.node_args, *extra), log_level="INFO").start()
        return self.node

    def start_worker(self, rank: int, die_at: str | None = None, nodes: str | None = None) -> subprocess.Popen:
        assert self.node is not None
        self.launches += 1
        command = [sys.executable, "-m", "tests.faults.worker_program", "--nodes", nodes or self.node.address, "--rank", str(rank)]
        command += ["--world", str(WORLD), "--steps", str(STEPS), "--mode", self.mode, "--out", str(self.out), "--timeout", str(self.worker_timeout_s)]
        if die_at:
            command += ["--die-at", die_at]
        log = open(self.workdir / f"worker{rank}.{self.launches}.log", "w")
        self.workers[rank] = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        return self.workers[rank]

    def wait(self, rank: int, timeout_s: float = 120.0) -> int:
        try:
            return self.workers[rank].wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker {rank} still runs after {timeout_s} s:\n{self.logs()}") from None

    def logs(self) -> str:
        parts = [f"--- {path.name}\n{path.read_text()[-2500:]}" for path in sorted(self.workdir.glob("worker*.log"))]
        if self.node is not None:
            parts.append(f"--- node\n{self.node.log_text()[-4000:]}")
        return "\n".join(parts)

    def result(self) -> dict[str, torch.Tensor]:
        return torch.load(self.out)

    def close(self) -> None:
        for process in self.workers.values():
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait(10)
        if self.node is not None:
            self.node.stop()


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """0.0 when every tensor is bitwise equal, else the largest absolute difference."""
    assert a.keys() == b.keys()
    worst = 0.0
    for name in a:
        if not torch.equal(a[name], b[name]):
            worst = max(worst, float((a[name] - b[name]).abs().max()), 1e-45)
    return worst
