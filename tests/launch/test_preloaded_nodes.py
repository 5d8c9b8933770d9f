"""The suite's forked nodes (tests/preloaded_nodes.py) behave as the fresh processes they stand in for:
a pid of their own, the node's output in its log, Popen's wait/kill/exit statuses, a restart in place."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from netoptim.launch.processes import NodeProcess
from tests.preloaded_nodes import ForkedNode


def test_a_forked_node_is_killed_waited_for_and_restarted_like_a_fresh_one(tmp_path):
    node = NodeProcess(tmp_path, name="forked").start()
    try:
        process = node.process
        assert process is not None
        if os.environ.get("NETOPTIM_TEST_FRESH_NODES") != "1":
            assert isinstance(process, ForkedNode), "the suite's nodes are forked from the preloaded interpreter"
        assert process.pid != os.getpid() and os.path.exists(f"/proc/{process.pid}")
        assert process.poll() is None and process.returncode is None
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(0.1)
        process.kill()
        assert process.wait(10) == -signal.SIGKILL and process.poll() == -signal.SIGKILL
        process.kill()  # once it has been waited for, a signal goes nowhere (its pid may be another's now)
        assert "serving on" in node.log_text()

        node.start()  # the same command again, as a restarted node is
        assert node.process is not process and node.process is not None and node.process.poll() is None
        assert node.stop() == 0, node.log_text()[-2000:]
        assert "stopped on SIGTERM" in node.log_text()
    finally:
        node.stop()  # where an assertion failed first
