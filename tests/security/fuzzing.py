"""What the fuzz tests share: the seed and the time budget from the environment, and a node daemon in
a child process whose memory is watched (a crash is then an exit status, not a dead test process).

``NETOPTIM_FUZZ_SEED`` fixes the seed (default: a new one every run, printed at the start of each
test and named in every failure); ``NETOPTIM_FUZZ_SECONDS`` is the time each fuzz loop runs
(default :data:`DEFAULT_SECONDS`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from netoptim.launch.processes import NodeProcess

DEFAULT_SECONDS = 4.0
"""Seconds of fuzzing per loop unless NETOPTIM_FUZZ_SECONDS says otherwise."""

HARD_CEILING_BYTES = 3 << 30
"""The watchdog kills a node whose resident memory goes over this: a finding must not take the
machine (and the other tests on it) down with it."""


def fuzz_seed() -> int:
    """NETOPTIM_FUZZ_SEED, or a fresh random seed."""
    text = os.environ.get("NETOPTIM_FUZZ_SEED", "").strip()
    return int(text, 0) if text else secrets.randbits(32)


def fuzz_seconds() -> float:
    """NETOPTIM_FUZZ_SECONDS, or :data:`DEFAULT_SECONDS`."""
    text = os.environ.get("NETOPTIM_FUZZ_SECONDS", "").strip()
    return float(text) if text else DEFAULT_SECONDS


@contextlib.contextmanager
def seed_named_on_failure(seed: int) -> Iterator[None]:
    """Re-raise an assertion failure with the seed that reproduces it."""
    print(f"fuzz seed {seed} (NETOPTIM_FUZZ_SEED={seed} replays it), {fuzz_seconds():.1f} s per loop")
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n-- fuzz seed {seed}: rerun with NETOPTIM_FUZZ_SEED={seed}") from exc


def status_bytes(pid: int, field: str) -> int | None:
    """A ``kB`` field of /proc/PID/status (VmRSS, VmHWM) in bytes; ``None`` once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return None


class WatchedNode:
    """A ``netoptim node`` child process (see :class:`NodeProcess`) whose resident memory a thread
    samples: above :data:`HARD_CEILING_BYTES` it is killed and :attr:`killed_for_memory` set."""

    def __init__(self, workdir: Path, name: str, extra_args: Sequence[str] = ()) -> None:
        self.node = NodeProcess(workdir, name=name, extra_args=tuple(extra_args), log_level="INFO")
        self.killed_for_memory = False
        self.pid = 0
        self.start_peak = 0
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def address(self) -> str:
        return self.node.address

    @property
    def admin_address(self) -> str:
        return self.node.admin_address

    def start(self) -> WatchedNode:
        self.node.start()
        assert self.node.process is not None
        self.pid = self.node.process.pid
        self.start_peak = status_bytes(self.pid, "VmHWM") or 0
        self._watcher = threading.Thread(target=self._watch, name="rss-watch", daemon=True)
        self._watcher.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            rss = status_bytes(self.pid, "VmRSS")
            if rss is None:
                return
            if rss > HARD_CEILING_BYTES:
                self.killed_for_memory = True
                assert self.node.process is not None
                self.node.process.kill()
                return

    def alive(self) -> bool:
        return self.node.process is not None and self.node.process.poll() is None

    def peak_growth(self) -> int:
        """How far the peak resident memory (VmHWM) went above its value once the node was ready."""
        peak = status_bytes(self.pid, "VmHWM")
        return 0 if peak is None else peak - self.start_peak

    def health(self) -> str:
        """A sentence for failure messages: running or how it ended, and the end of its log."""
        if self.alive():
            state = "running"
        elif self.killed_for_memory:
            state = f"killed by the test: resident memory over {HARD_CEILING_BYTES >> 20} MiB"
        else:
            assert self.node.process is not None
            state = f"exited with status {self.node.process.returncode}"
        return f"node {state}; end of its log:\n{self.node.log_text()[-3000:]}"

    def stop(self) -> int | None:
        """SIGTERM (SIGKILL after 20 s, see :meth:`NodeProcess.stop`); the exit status."""
        self._stop.set()
        return self.node.stop()


def watched_nodes(tmp_path: Path) -> Iterator[Callable[..., WatchedNode]]:
    """Body of a fixture that starts :class:`WatchedNode` processes and stops every one of them at
    the end of the test, also when the test failed before it stopped them itself."""
    started: list[WatchedNode] = []

    def start(name: str, extra_args: Sequence[str] = ()) -> WatchedNode:
        node = WatchedNode(tmp_path, name, extra_args)
        started.append(node)
        return node.start()

    yield start
    for node in started:
        node.stop()
