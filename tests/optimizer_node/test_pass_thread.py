"""The update passes' own thread (``--pass-thread``): order, waiting, errors, and waking the endpoint."""

from __future__ import annotations

import threading
import time

import pytest

from optimizer_node.pass_thread import DEPTH, PassThread
from transport.zmq_backend import ZmqTransport


def test_passes_end_in_order_and_wait_returns_what_ended_up_to_a_bucket() -> None:
    release = threading.Event()
    ran: list[str] = []

    def run(item: str) -> None:
        release.wait(5)
        ran.append(item)

    passes: PassThread[str] = PassThread(run)
    try:
        passes.submit(3, "three")
        passes.submit(1, "one")
        assert not passes.has_room and passes.busy == DEPTH and passes.holds(1)
        assert passes.collect() == []  # nothing ended yet
        release.set()
        ended = passes.wait(3)
        assert ended[0] == ("three", None) and not passes.holds(3)
        ended += passes.wait()
        assert ended == [("three", None), ("one", None)] and ran == ["three", "one"]
        assert passes.busy == 0 and passes.has_room
    finally:
        passes.close()
        passes.close()  # idempotent


def test_a_pass_that_raises_hands_its_error_to_the_loop() -> None:
    def run(item: int) -> None:
        if item == 2:
            raise RuntimeError("bug in the pass")

    passes: PassThread[int] = PassThread(run)
    try:
        passes.submit(1, 1)
        passes.submit(2, 2)
        ended = passes.wait()
        assert [(item, type(error)) for item, error in ended] == [(1, type(None)), (2, RuntimeError)]
    finally:
        passes.close()


def test_a_pass_that_ends_wakes_the_nodes_wait_for_messages() -> None:
    transport = ZmqTransport()
    endpoint = transport.bind("tcp://127.0.0.1:0")
    passes: PassThread[float] = PassThread(time.sleep)
    try:
        assert endpoint.wake_on(passes.wake_fd)
        passes.submit(0, 0.05)
        started = time.monotonic()
        assert endpoint.recv(5.0) is None
        assert time.monotonic() - started < 2.0, "the pass's end must wake the wait, not its timeout"
        assert [item for item, _ in passes.collect()] == [0.05]
        started = time.monotonic()
        assert endpoint.recv(0.2) is None  # drained: the next wait runs its course
        assert time.monotonic() - started == pytest.approx(0.2, abs=0.15)
    finally:
        passes.close()
        endpoint.close()
        transport.close()
