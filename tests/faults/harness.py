"""Running a small job as real processes (a node, worker processes) and killing them on purpose."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from netoptim.launch.processes import NodeProcess
from tests.node_flags import with_node_args

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
    worker_args: tuple[str, ...] = ()
    """Added to every worker's command (``--no-same-host``, ``--heartbeat 0.5``, ...)."""
    worker_nodes: str | None = None
    """The address workers are given (a proxy's); default: the node's."""
    node: NodeProcess | None = None
    workers: dict[int, subprocess.Popen] = field(default_factory=dict)
    launches: int = 0
    previous_logs: list[str] = field(default_factory=list)

    @property
    def out(self) -> Path:
        return self.workdir / "final.pt"

    def start_node(self, name: str = "node", extra: tuple[str, ...] = (), listen: str = "tcp://127.0.0.1:0") -> NodeProcess:
        self.node = NodeProcess(self.workdir, name=name, listen=listen, extra_args=with_node_args((*self.node_args, *extra)), log_level="INFO").start()
        return self.node

    def restart_node(self, name: str = "resumed") -> NodeProcess:
        """The node again, on the same address with the same flags plus ``--resume`` (it must be dead)."""
        assert self.node is not None and self.node.process is not None and self.node.process.poll() is not None
        self.previous_logs.append(self.node.log_text())
        return self.start_node(name, ("--resume",), listen=self.node.address)

    def start_worker(self, rank: int, die_at: str | None = None, nodes: str | None = None, extra: tuple[str, ...] = ()) -> subprocess.Popen:
        assert self.node is not None
        self.launches += 1
        command = [sys.executable, "-m", "tests.faults.worker_program", "--nodes", nodes or self.worker_nodes or self.node.address, "--rank", str(rank)]
        command += ["--world", str(WORLD), "--steps", str(STEPS), "--mode", self.mode, "--out", str(self.out), "--timeout", str(self.worker_timeout_s)]
        command += [*self.worker_args, *extra]
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

    def worker_log(self, rank: int) -> str:
        """The log of the latest process of ``rank``."""
        return max(self.workdir.glob(f"worker{rank}.*.log"), key=lambda path: int(path.suffixes[0][1:])).read_text()

    def logs(self) -> str:
        parts = [f"--- {path.name}\n{path.read_text()[-2500:]}" for path in sorted(self.workdir.glob("worker*.log"))]
        parts += [f"--- earlier node\n{text[-2000:]}" for text in self.previous_logs]
        if self.node is not None:
            parts.append(f"--- node\n{self.node.log_text()[-4000:]}")
        return "\n".join(parts)

    def result(self) -> dict[str, torch.Tensor]:
        return torch.load(self.out)

    def close(self) -> None:
        for process in [*self.workers.values(), *([self.node.process] if self.node and self.node.process else [])]:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)  # one a test stopped must see the SIGTERM
        for process in self.workers.values():
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait(10)
        if self.node is not None:
            self.node.stop()


def stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP): state T in /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def continue_after(pid: int, seconds: float, appeared_within_s: float = 120.0) -> threading.Thread:
    """A thread that waits for ``pid`` to be stopped, lets it stay stopped ``seconds``, then sends it
    SIGCONT; ``thread.stopped_s`` is how long it was held (0.0 when it never stopped)."""

    def run() -> None:
        deadline = time.monotonic() + appeared_within_s
        while not stopped(pid):
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        began = time.monotonic()
        time.sleep(seconds)
        os.kill(pid, signal.SIGCONT)
        thread.stopped_s = time.monotonic() - began  # type: ignore[attr-defined]

    thread = threading.Thread(target=run, daemon=True)
    thread.stopped_s = 0.0  # type: ignore[attr-defined]
    thread.start()
    return thread


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


class References:
    """Final parameters of uninterrupted runs, per mode, each computed on first use and kept for the session."""

    def __init__(self, make_dir) -> None:
        self._make_dir = make_dir
        self._results: dict[str, dict[str, torch.Tensor]] = {}

    def __getitem__(self, mode: str) -> dict[str, torch.Tensor]:
        if mode not in self._results:
            job = Job(self._make_dir(f"reference-{mode}"), mode=mode)
            try:
                job.start_node()
                for rank in range(WORLD):
                    job.start_worker(rank)
                for rank in range(WORLD):
                    assert job.wait(rank) == 0, job.logs()
                self._results[mode] = job.result()
            finally:
                job.close()
        return self._results[mode]


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """0.0 when every tensor is bitwise equal, else the largest absolute difference."""
    assert a.keys() == b.keys()
    worst = 0.0
    for name in a:
        if not torch.equal(a[name], b[name]):
            worst = max(worst, float((a[name] - b[name]).abs().max()), 1e-45)
    return worst
