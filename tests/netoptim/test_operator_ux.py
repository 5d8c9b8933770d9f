"""What an operator sees at the edges: a watch that loses its node says so, Ctrl-C is quiet."""

from __future__ import annotations

import signal
import subprocess
import sys
import time


def start_watch(address: str) -> subprocess.Popen:
    """``netoptim admin watch`` on ``address``, returned once it says it is subscribed (not before:
    a process still starting up would take a signal elsewhere)."""
    # A child inherits an ignored SIGINT, and Python then leaves it ignored: libraries that run
    # in-process in this test worker (teardown code of distributed frameworks) may have left it so.
    # The watch starts as a shell's foreground command does, with SIGINT at its default.
    # Reset in the child's own code, not with preexec_fn (which runs between fork and exec of a
    # threaded test worker and can abort the child: exit -6 in CI).
    launch = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        f"sys.argv = ['netoptim', 'admin', '--target', {address!r}, 'watch']; runpy.run_module('netoptim', run_name='__main__')"
    )
    watch = subprocess.Popen([sys.executable, "-c", launch], stderr=subprocess.PIPE, text=True)
    assert watch.stderr is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = watch.stderr.readline()
        if "watching" in line:
            return watch
        assert line, f"the watch ended before subscribing (exit {watch.wait()})"
    raise AssertionError("the watch did not subscribe within 60 s")


def test_watch_exits_non_zero_when_the_node_goes_away(start_node):
    node = start_node(extra_args=("--admin", "127.0.0.1:0"))
    watch = start_watch(node.admin_address)
    assert node.stop() == 0
    _, stderr = watch.communicate(timeout=30)
    assert watch.returncode == 1, stderr
    assert "Traceback" not in stderr and stderr.strip()


def test_ctrl_c_is_quiet(start_node):
    node = start_node(extra_args=("--admin", "127.0.0.1:0"))
    watch = start_watch(node.admin_address)
    watch.send_signal(signal.SIGINT)
    _, stderr = watch.communicate(timeout=30)
    assert watch.returncode == 130 and "Traceback" not in stderr, stderr


def test_no_progress_reaches_the_processes_a_command_starts(monkeypatch):
    import os

    from netoptim.console import _run_command, parse_command_line

    monkeypatch.setenv("TQDM_DISABLE", "0")  # restored (unset) after the test
    args = parse_command_line(["--no-progress", "plan-memory", "--params", "1M", "--workers", "1"])
    assert _run_command(args) == 0
    assert os.environ["TQDM_DISABLE"] == "1"
