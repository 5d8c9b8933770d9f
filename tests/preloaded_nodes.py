"""Node daemons forked from an interpreter that has imported the node's modules already.

A fresh ``python -m netoptim node`` spends ~2 s of a core importing torch, numba, gRPC and ZeroMQ
before it listens, and the suite starts a few hundred nodes on a 2-core machine. The launcher here
forks each node from a ``multiprocessing`` fork server that did those imports once (no threads run
there: nothing has been started, only imported). What runs in the child is the same command line
through the same entry point (:func:`netoptim.console.console`), in a process of its own with its own pid,
its output in the node's log file: SIGTERM, SIGKILL and restarts behave as for any other process.
Only the environment is set from the caller's at each start; what a library reads from it at import
(OpenMP's thread count, for one) is the server's, which the node's ``--threads`` overrides anyway;
OpenMP's wait policy is the one ``netoptim node`` picks for nodes that share their CPUs (sleep).
``NETOPTIM_TEST_FRESH_NODES=1`` starts every node in a fresh interpreter instead.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver as forkserver
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from netoptim.launch.processes import ChildProcess, popen_launcher
from netoptim.launch.thread_wait import POLICY_ENV

PRELOAD = ["torch", "numpy", "numba", "zmq", "grpc", "netoptim.console", "netoptim.cli.node", "optimizer_node.daemon"]
"""What the fork server imports before it forks the first node."""


class ForkedNode:
    """A node process forked by the server, with the calls of ``subprocess.Popen`` that tests make."""

    def __init__(self, process: multiprocessing.process.BaseProcess, command: Sequence[str]) -> None:
        self._process = process
        self._command = list(command)
        self.pid: int = process.pid  # type: ignore[assignment]

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self._command, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # like Popen: never signal a pid that was reaped (and may be reused)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class PreloadedNodeLauncher:
    """Forks ``python -m netoptim ...`` commands from a preloaded fork server; anything else gets a
    fresh interpreter, and so does every command while ``fresh`` is set (tests that measure a node's
    resident memory: a forked child faults in again the code pages its server had, and counts them as
    growth) or with ``NETOPTIM_TEST_FRESH_NODES=1``."""

    def __init__(self) -> None:
        self._context: multiprocessing.context.BaseContext | None = None
        self.fresh = False

    def __call__(self, command: Sequence[str], log_file: Path) -> ChildProcess:
        if self.fresh or list(command[:3]) != [sys.executable, "-m", "netoptim"] or os.environ.get("NETOPTIM_TEST_FRESH_NODES") == "1":
            return popen_launcher(command, log_file)
        if self._context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            self._context = context
            _start_server_with_sleeping_update_threads()
        # daemon: a node a test leaves running is stopped when the test process ends
        process = self._context.Process(target=run_command, args=(list(command[3:]), str(log_file), dict(os.environ)), daemon=True)
        process.start()
        return ForkedNode(process, command)


def _start_server_with_sleeping_update_threads() -> None:
    """Start the fork server with ``OMP_WAIT_POLICY=PASSIVE``: its torch import loads OpenMP, which
    reads the policy then, once, for every node forked from it. The tests' nodes share the machine's
    CPUs with their workers, where ``netoptim node`` has its update threads sleep between passes
    (netoptim/launch/thread_wait.py); this process's own environment stays as it was."""
    previous = os.environ.get(POLICY_ENV)
    os.environ[POLICY_ENV] = "PASSIVE"
    try:
        forkserver.ensure_running()
    finally:
        if previous is None:
            del os.environ[POLICY_ENV]
        else:
            os.environ[POLICY_ENV] = previous


def run_command(argv: list[str], log_file: str, environment: dict[str, str]) -> None:
    """In the forked child: output to the log file, the caller's environment, then the command."""
    log_fd = os.open(log_file, os.O_WRONLY | os.O_APPEND)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    os.environ.clear()
    os.environ.update(environment)
    sys.argv = ["netoptim", *argv]
    from netoptim.console import console

    console()
