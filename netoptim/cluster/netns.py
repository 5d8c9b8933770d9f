"""Thin wrappers around ``ip`` and ``tc``: namespaces, the processes inside them, commands that run there.

Everything goes through the ``ip`` and ``tc`` programs (iproute2) rather than netlink from Python, so
what this package does to the machine is exactly what its log shows, and can be repeated by hand.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)


class NetnsError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message has the command and what it printed."""


def require_root() -> None:
    """Raise ``PermissionError`` unless this process can create network namespaces (root)."""
    if os.geteuid() != 0:
        raise PermissionError("the emulated cluster creates network namespaces, veths, a bridge and tc qdiscs: run it as root (e.g. sudo)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise PermissionError(f"the emulated cluster needs the {tool!r} program (iproute2), which is not on PATH")


def run(*argv: str, check: bool = True, timeout_s: float = 30.0) -> str:
    """Run one command (``ip ...``, ``tc ...``), returning its stdout; ``NetnsError`` when it fails."""
    log.debug("$ %s", " ".join(argv))
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"{' '.join(argv)}: no answer within {timeout_s:.0f} s") from exc
    if check and result.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed (status {result.returncode}): {result.stderr.strip()}")
    return result.stdout


def list_namespaces() -> list[str]:
    """Names of the named network namespaces (``ip netns list``)."""
    names = []
    for line in run("ip", "netns", "list").splitlines():
        if line.strip():
            names.append(line.split()[0])  # "NAME (id: 3)"
    return names


def add_namespace(name: str) -> None:
    run("ip", "netns", "add", name)
    run("ip", "-n", name, "link", "set", "lo", "up")  # ranks on one host talk over loopback


def namespace_pids(name: str) -> list[int]:
    """Processes running in namespace ``name`` (none when it does not exist)."""
    output = run("ip", "netns", "pids", name, check=False)
    return [int(word) for word in output.split() if word.isdigit()]


def kill_namespace_processes(name: str, grace_s: float = 3.0) -> int:
    """SIGTERM every process in namespace ``name``, SIGKILL what is left after ``grace_s``; returns how
    many there were. Only processes inside this run's namespaces are touched: those are ours."""
    pids = namespace_pids(name)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = [pid for pid in pids if _alive(pid)]
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    return len(pids)


def delete_namespace(name: str) -> None:
    """Kill what runs inside, then delete the namespace; its interfaces go with it (a veth whose peer
    is in another namespace disappears as a pair, a bridge with its namespace)."""
    kill_namespace_processes(name)
    run("ip", "netns", "delete", name, check=False)


def in_namespace(name: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside namespace ``name``; it also dies with the process that starts it (setpriv's
    parent-death signal), so a runner killed with SIGKILL leaves no trainers behind in the namespaces."""
    guard = ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []
    return [*guard, "ip", "netns", "exec", name, *argv]


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
