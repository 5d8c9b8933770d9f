"""Shared fixtures: real optimizer-node daemons in child processes on OS-chosen ports."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from netoptim.launch.processes import NodeProcess, use_node_launcher
from optimizer_node.update.kernels import compiled_update
from tests.node_flags import with_node_args
from tests.preloaded_nodes import PreloadedNodeLauncher
from tests.transport.availability import check_mooncake

NODE_LAUNCHER = PreloadedNodeLauncher()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the nodes' update loop once, before any node starts (numba caches it on disk): the
    daemons the tests start then load it instead of each waiting for a compile of its own."""
    compiled_update.usable()  # fills numba's cache (in a child process) and checks the loop
    use_node_launcher(NODE_LAUNCHER)  # nodes forked with their imports done (tests/preloaded_nodes.py)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("mooncake") is not None:
        check_mooncake()
    NODE_LAUNCHER.fresh = item.get_closest_marker("fresh_nodes") is not None  # before the test's fixtures start nodes


@pytest.fixture
def start_node(tmp_path) -> Iterator[Callable[..., NodeProcess]]:
    """Start ``netoptim node`` processes; all are stopped (SIGTERM) at the end of the test."""
    started: list[NodeProcess] = []

    def start(name: str = "node0", listen: str = "tcp://127.0.0.1:0", extra_args: tuple[str, ...] = ()) -> NodeProcess:
        node = NodeProcess(tmp_path, name=name, listen=listen, extra_args=with_node_args(tuple(extra_args)), log_level="DEBUG")
        started.append(node.start())
        return node

    yield start
    for node in started:
        was_running = node.process is not None and node.process.poll() is None
        status = node.stop()
        if was_running:  # a node a test killed on purpose is not checked
            assert status == 0, f"node exited with {status} on SIGTERM:\n{node.log_text()[-3000:]}"


@pytest.fixture
def node(start_node) -> NodeProcess:
    return start_node()
