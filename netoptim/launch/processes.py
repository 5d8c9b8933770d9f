"""Starting nodes and workers on this machine, as child processes: for ``netoptim demo``, the benchmarks,
the planner's calibration, the emulated cluster and the tests."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


class ChildProcess(Protocol):
    """A started node process, as :class:`NodeProcess` uses it (what ``subprocess.Popen`` offers)."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


NodeLauncher = Callable[[Sequence[str], Path], ChildProcess]
"""Starts ``command`` (``python -m netoptim ... node ...``) with its output appended to the log file."""


def popen_launcher(command: Sequence[str], log_file: Path) -> ChildProcess:
    """A fresh interpreter for the command, as a shell would start it."""
    with open(log_file, "ab") as log_handle:
        return subprocess.Popen(list(command), stdout=log_handle, stderr=subprocess.STDOUT)


_node_launcher: NodeLauncher = popen_launcher


def use_node_launcher(launcher: NodeLauncher) -> NodeLauncher:
    """Start every later :class:`NodeProcess` with ``launcher``; returns the one it replaces.

    The test suite starts hundreds of nodes and forks them from an interpreter that has imported
    the node's modules already (each fresh interpreter spends ~2 s of a core importing torch)."""
    global _node_launcher
    previous, _node_launcher = _node_launcher, launcher
    return previous


class NodeProcess:
    """A ``netoptim node`` daemon in a child process, on an OS-chosen port.

    ``start()`` returns once the node has written its ready file; ``stop()`` sends SIGTERM and waits.
    Local nodes share the host's cores with the workers, so they run one update thread unless
    ``extra_args`` says otherwise: with more, every small kernel waits for a second thread that a busy
    core cannot schedule, and an update step took twice as long, with stalls of 0.3 s (measured).
    """

    def __init__(
        self,
        workdir: str | Path,
        *,
        name: str = "node0",
        listen: str = "tcp://127.0.0.1:0",
        extra_args: Sequence[str] = (),
        log_level: str = "INFO",
        threads: int = 1,
        nice: int = 0,
    ) -> None:
        self.ready_file = Path(workdir) / f"{name}.ready.json"
        self.log_file = Path(workdir) / f"{name}.log"
        self.command = [
            sys.executable,
            "-m",
            "netoptim",
            "--log-level",
            log_level,
            "node",
            "--listen",
            listen,
            "--ready-file",
            str(self.ready_file),
            "--node-id",
            name,
            *([] if "--threads" in extra_args else ["--threads", str(threads)]),
            *([] if not nice or "--nice" in extra_args else ["--nice", str(nice)]),
            *extra_args,
        ]
        self.process: ChildProcess | None = None
        self.address = ""
        self.admin_address = ""
        self.metrics_url = ""
        self.same_host_address = ""

    def start(self, timeout_s: float = 60.0) -> NodeProcess:
        self.ready_file.unlink(missing_ok=True)
        self.log_file.write_bytes(b"")
        self.process = _node_launcher(self.command, self.log_file)
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"node exited with status {self.process.returncode} before it was ready:\n{self.log_text()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"node not ready after {timeout_s:.0f} s:\n{self.log_text()}")
            time.sleep(0.05)
        ready = json.loads(self.ready_file.read_text())
        self.address = ready["data"]
        self.admin_address = ready.get("admin", "")
        self.metrics_url = ready.get("metrics", "")
        self.same_host_address = ready.get("same_host", "")
        return self

    def log_text(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit status."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("node did not stop within %.0f s; killing it", timeout_s)
            self.process.kill()
            return self.process.wait()

    def __enter__(self) -> NodeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PICKED_PORT = 10000


def _ephemeral_low(path: Path = EPHEMERAL_PORTS) -> int | None:
    """The first port of the range the kernel hands out to sockets bound to port 0 (Linux), if it says."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 a moment ago (for a ``torch.distributed`` rendezvous, which needs
    one named in advance). Picked at random below the kernel's ephemeral range, where no socket
    bound to port 0 (a node's, a test's, a connection's own end) can take it between this check and
    the rendezvous binding it: a port the kernel chose itself went to another process in that
    window under parallel tests (``EADDRINUSE`` at the rendezvous). Where the range is unknown or
    leaves no room below it, the kernel picks."""
    low = _ephemeral_low()
    if low is not None and low - LOWEST_PICKED_PORT >= 1000:
        for _ in range(100):
            port = random.randrange(LOWEST_PICKED_PORT, low)
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_workers(
    script_args: Sequence[str],
    world_size: int,
    *,
    module: str = "netoptim.recipes.train_gpt",
    timeout_s: float = 1800.0,
    threads_per_worker: int = 1,
    quiet: bool = False,
) -> int:
    """Run ``world_size`` worker processes like ``torchrun`` does (RANK, WORLD_SIZE, LOCAL_RANK and a
    MASTER_ADDR/MASTER_PORT rendezvous for ``torch.distributed`` in the environment).

    Rank 0 keeps the terminal; the others log to stderr only on failure. When one fails, the others
    are stopped and its exit status is returned.
    """
    processes: list[subprocess.Popen] = []
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for rank in range(world_size):
        env = {
            **os.environ,
            **rendezvous,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": str(threads_per_worker),
        }
        stdout = None if rank == 0 and not quiet else subprocess.DEVNULL
        processes.append(subprocess.Popen([sys.executable, "-m", module, *script_args], env=env, stdout=stdout))
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            statuses = [p.poll() for p in processes]
            failed = [(rank, status) for rank, status in enumerate(statuses) if status not in (None, 0)]
            if failed:
                rank, status = failed[0]
                log.error("worker rank %d exited with status %d; stopping the others", rank, status)
                return status or 1
            if all(status == 0 for status in statuses):
                return 0
            if time.monotonic() > deadline:
                log.error("workers did not finish within %.0f s", timeout_s)
                return 1
            time.sleep(0.1)
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


def run_pipeline_job(
    stages: int, replicas: int, microbatches: int, schedule: str, cuts: Sequence[int], *,
    global_batch: int, model: dict[str, int], steps: int, nodes_per_stage: int = 1, timeout_s: float = 600.0,
) -> list[dict]:  # fmt: skip
    """Train ``examples/train_gpt_pipeline.py``'s GPT (``model``: its shape flags) for ``steps`` steps
    on ``stages x replicas`` local ranks and fresh local nodes; returns every rank's ``--report``."""
    with tempfile.TemporaryDirectory(prefix="netoptim-pipeline-") as workdir:
        nodes = [NodeProcess(workdir, name=f"node{i}", log_level="WARNING") for i in range(stages * nodes_per_stage)]
        try:
            for node in nodes:
                node.start()
            script = [
                "--nodes", ",".join(n.address for n in nodes), "--stages", str(stages), "--microbatches", str(microbatches),
                "--schedule", schedule, "--cuts", ",".join(map(str, cuts)), "--steps", str(steps), "--global-batch", str(global_batch),
                "--report", str(Path(workdir) / "report"), "--quiet", *[f"--{key.replace('_', '-')}={value}" for key, value in model.items()],
            ]  # fmt: skip
            status = run_workers(script, stages * replicas, module="netoptim.recipes.train_gpt_pipeline", timeout_s=timeout_s, quiet=True)
            if status != 0:
                raise RuntimeError(f"the pipeline ranks (P={stages}, D={replicas}, M={microbatches}, {schedule}) failed with status {status}; "
                                   "run the recipe by hand with NETOPTIM_LOG_LEVEL=INFO to see why")  # fmt: skip
            return [json.loads(p.read_text()) for p in sorted((Path(workdir) / "report").glob("rank*.json"))]
        finally:
            for node in nodes:
                node.stop()
