"""The compiled loop's bitwise check runs once per build and CPU: its verdict is on record beside
numba's cache under a fingerprint of what it depends on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from optimizer_node.update.kernels import compiled_cache

pytest.importorskip("numba")


def test_a_verdict_is_on_record_for_its_build_only_and_a_damaged_record_means_check_again(tmp_path):
    source = tmp_path / "loop.py"
    source.write_text("x = 1\n")
    fingerprint = compiled_cache.build_fingerprint([source])
    assert fingerprint == compiled_cache.build_fingerprint([source]), "the same build, the same fingerprint"
    records = tmp_path / "cache"
    assert compiled_cache.recorded_verdict(records, fingerprint) == (False, None)
    compiled_cache.record_verdict(records, fingerprint, None)
    assert compiled_cache.recorded_verdict(records, fingerprint) == (True, None)
    source.write_text("x = 2\n")  # another loop: checked again
    changed = compiled_cache.build_fingerprint([source])
    assert changed != fingerprint and compiled_cache.recorded_verdict(records, changed) == (False, None)
    compiled_cache.record_verdict(records, changed, "the bf16 cast")
    assert compiled_cache.recorded_verdict(records, changed) == (True, "the bf16 cast")
    assert compiled_cache.recorded_verdict(records, fingerprint) == (False, None), "only the latest build is kept"
    (records / compiled_cache.VERDICT_FILE).write_text("{not json")
    assert compiled_cache.recorded_verdict(records, changed) == (False, None)
    (records / compiled_cache.VERDICT_FILE).write_text(json.dumps({changed: 3}))
    assert compiled_cache.recorded_verdict(records, changed) == (False, None), "a verdict is a difference named, or none"
    blocked = tmp_path / "file"
    blocked.write_text("")
    compiled_cache.record_verdict(blocked / "cache", fingerprint, None)  # nowhere to write: no error


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_compile_child_ends_with_the_node_that_started_it(tmp_path):
    """A node stopped during its first minute does not leave its compile child running on alone."""
    starter = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-m', 'optimizer_node.update.kernels.warmup', str(os.getpid())])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}  # an empty cache: the child compiles for a while
    node = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True, env=env)
    child = int(node.stdout.readline())
    time.sleep(1.0)
    node.kill()
    node.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":  # ended; whoever adopted it has not reaped it yet
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the compile child outlived the process that started it")
