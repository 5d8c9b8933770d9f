"""The update passes' own thread (``--pass-thread``): order, waiting, errors, and waking the endpoint."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from optimizer_node.update.adamw import adamw_update
from optimizer_node.update.pass_thread import DEPTH, PassThread, shorten_switch_interval
from protos.job.placement import ParamSpec
from protos.job.spec import JobSpec
from tests.optimizer_node.raw_client import HYPER, RawWorker
from transport.wire import Header, MsgType, tensor_header
from transport.zeromq.backend import ZmqTransport


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


def test_the_switch_interval_is_shortened_never_lengthened() -> None:
    before = sys.getswitchinterval()
    try:
        assert shorten_switch_interval(before / 10) == before
        assert sys.getswitchinterval() == pytest.approx(before / 10)
        assert shorten_switch_interval(before) == pytest.approx(before / 10)  # a longer one is not taken
        assert sys.getswitchinterval() == pytest.approx(before / 10)
    finally:
        sys.setswitchinterval(before)


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
        passes.drain_wakeup()
        assert [item for item, _ in passes.collect()] == [0.05]
        started = time.monotonic()
        assert endpoint.recv(0.2) is None  # drained: the next wait runs its course
        assert time.monotonic() - started == pytest.approx(0.2, abs=0.15)
    finally:
        passes.close()
        endpoint.close()
        transport.close()


@pytest.mark.parametrize("path", ["tcp", "same-host"])
def test_a_pull_while_a_pass_runs_gets_whole_values_of_one_step(start_node, path) -> None:
    """With ``--pass-thread`` a PULL of a bucket whose pass is running waits for the pass: the values
    it gets are those of the step before the update or of the step after, never half of each."""
    numel = 1 << 22  # a pass of tens of milliseconds here: the pull, sent right after the push, comes during it
    job = JobSpec(world_size=1, num_nodes=1, bucket_numel=numel, wire_dtype="float32", max_grad_norm=None, params=(ParamSpec("w", (numel,), "float32", 0),))
    node = start_node(extra_args=("--pass-thread",))
    transport = ZmqTransport()
    worker = RawWorker(transport, node.address if path == "tcp" else node.same_host_address, 0)
    try:
        assert worker.hello(job).meta["needs_init"] == [0]
        generator = torch.Generator().manual_seed(3)
        values = torch.randn(numel, generator=generator)
        assert worker.request(tensor_header(MsgType.INIT, values, rank=0, bucket_id=0), values).msg_type == MsgType.ACK
        if path == "same-host":  # the board is offered, mapped, and the node told
            for _ in range(2):
                worker.request(Header(msg_type=MsgType.QUERY, rank=0))
        param, exp_avg, exp_avg_sq, step = values.clone(), torch.zeros(numel), torch.zeros(numel), torch.zeros(())
        during = 0
        for at in range(3):
            before = param.clone()
            grad = torch.randn(numel, generator=generator) * 1e-2
            worker.push(0, at, grad)
            worker.client.send(Header(msg_type=MsgType.PULL, rank=0, bucket_id=0))  # now: the current values
            adamw_update(param, grad.clone(), exp_avg, exp_avg_sq, step, HYPER, grad_divisor=torch.tensor(1.0))
            replies = [worker.reply(30.0) for _ in range(2)]  # the update's PARAMS and the pull's answer
            assert all(header.msg_type == MsgType.PARAMS for header, _ in replies)
            assert any(header.step == at + 1 and torch.equal(got, param) for header, got in replies)
            for header, got in replies:
                assert torch.equal(got, param if header.step == at + 1 else before), f"step {header.step}: values of two steps mixed"
            during += all(header.step == at + 1 for header, _ in replies)
        assert during >= 1, "every pull was answered before its update: the test did not reach a running pass"
        assert "interpreter switch interval 0.2 ms" in node.log_text()  # the loop hands the lock to the pass thread soon
    finally:
        worker.client.close()
        transport.close()
