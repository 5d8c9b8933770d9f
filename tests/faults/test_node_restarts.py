"""A node killed with SIGKILL and started again with --resume on the same address: the running
workers notice, reconnect by themselves (the same-host socket included), push again what the node
lost and end bitwise where an uninterrupted run ends. A node that does not come back, or comes back
at an older step, stops them with an error that names it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from netoptim.launch.processes import NodeProcess
from optimizer_node.faults import EXIT_STATUS
from tests.optimizer_node.test_recovery import train as train_threads

pytestmark = pytest.mark.faults

STEPS = 6
FAST = dict(heartbeat_s=0.2, silent_after_s=1.0, reconnect_s=30.0, timeout_s=60.0)


def train(address: str, **options) -> tuple[list[torch.Tensor] | None, list[BaseException]]:
    return train_threads(address, steps=STEPS, **options)


def crashing_node(
    start_node, tmp_path, crash_at: str, *, every: str = "1", resumed_every: tuple[str, ...] = ("--checkpoint-every", "1")
) -> tuple[str, threading.Thread]:
    """A node that checkpoints every ``every`` steps and crashes at ``crash_at``, and a started thread
    that starts it again on its address with ``--resume`` (and ``resumed_every``) once it died; join
    the thread after training."""
    checkpoints = str(tmp_path / "checkpoints")
    node = start_node("doomed", extra_args=("--checkpoint-dir", checkpoints, "--checkpoint-every", every, "--crash-at", crash_at))
    address = node.address

    def restart_when_dead() -> None:
        assert node.process.wait(30) == EXIT_STATUS
        start_node("resumed", listen=address, extra_args=("--checkpoint-dir", checkpoints, *resumed_every, "--resume"))

    restarter = threading.Thread(target=restart_when_dead)
    restarter.start()
    return address, restarter


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    with NodeProcess(tmp_path_factory.mktemp("reference")) as node:
        params, errors = train(node.address, **FAST)
    assert not errors, errors
    return params


PACED = dict(push_during_backward=True, pace_window_bytes=128 * 4)  # one bucket in flight: pushes wait for values during backward
OVERLAPPED = dict(overlap_forward=True)  # the values awaited by the next forward: the reconnect happens inside it


@pytest.mark.parametrize(
    ("crash_at", "options"),
    [("push:7", {}), ("update:5", {}), ("push:7", PACED), ("update:5", PACED), ("push:7", OVERLAPPED), ("update:5", OVERLAPPED)],
    ids=["push:7", "update:5", "push:7-paced", "update:5-paced", "push:7-overlap-forward", "update:5-overlap-forward"],
)
def test_workers_reconnect_to_a_restarted_node_and_continue_bitwise(start_node, tmp_path, uninterrupted, crash_at, options):
    address, restarter = crashing_node(start_node, tmp_path, crash_at)
    params, errors = train(address, **FAST, **options)
    restarter.join()
    assert not errors, errors
    assert all(torch.equal(a, b) for a, b in zip(params, uninterrupted, strict=True))


def test_workers_that_let_their_gradients_go_are_told_to_restart_and_then_end_bitwise(start_node, tmp_path, uninterrupted):
    """keep_step_gradients=False: a node restarted mid-step lost pushes the workers no longer hold;
    they stop with an error that says to restart them, and restarted (fresh workers that resume at the
    nodes' step) the job ends where an uninterrupted run ends."""
    address, restarter = crashing_node(start_node, tmp_path, "update:5")
    options = dict(FAST, **OVERLAPPED, keep_step_gradients=False)
    _params, errors = train(address, **options)
    restarter.join()
    assert errors and all(isinstance(e, RuntimeError) for e in errors), errors
    assert all("keep_step_gradients=False): restart the worker (it redoes step" in str(e) for e in errors), errors
    params, errors = train(address, **options)  # the workers restarted
    assert not errors, errors
    assert all(torch.equal(a, b) for a, b in zip(params, uninterrupted, strict=True))


def test_a_node_back_at_an_older_step_stops_the_workers(start_node, tmp_path):
    address, restarter = crashing_node(start_node, tmp_path, "update:11", every="2", resumed_every=())
    _params, errors = train(address, **FAST)
    restarter.join()
    assert errors and all(isinstance(e, RuntimeError) for e in errors), errors
    assert any(f"node {address} came back at step" in str(e) and "restart every worker" in str(e) for e in errors), errors


def test_a_node_that_does_not_come_back_is_named_within_the_deadline(start_node):
    node = start_node("doomed", extra_args=("--crash-at", "push:7"))
    started = time.monotonic()
    _params, errors = train(node.address, heartbeat_s=0.2, silent_after_s=1.0, reconnect_s=2.0, timeout_s=60.0)
    elapsed = time.monotonic() - started
    assert errors and elapsed < 20, (elapsed, errors)
    assert any(isinstance(e, ConnectionError) and f"node {node.address} stopped answering" in str(e) and "--resume" in str(e) for e in errors), errors


@pytest.mark.parametrize("crash_at", ["push:7", "update:5"])
def test_one_of_two_clipping_nodes_restarted_continues_bitwise(start_node, tmp_path, crash_at):
    """Global-norm clipping over two nodes: every step waits for both nodes' norm partials, so the
    restarted node must rebuild its part of the round (gradients pushed again, partial sent again)
    while the other node holds its own; the result is that of an uninterrupted run."""
    options = dict(FAST, max_grad_norm=0.05)
    with NodeProcess(tmp_path, name="ref0") as ref0, NodeProcess(tmp_path, name="ref1") as ref1:
        uninterrupted, errors = train([ref0.address, ref1.address], **options)
    assert not errors, errors
    steady = start_node("steady")
    address, restarter = crashing_node(start_node, tmp_path, crash_at)
    params, errors = train([steady.address, address], **options)
    restarter.join()
    assert not errors, errors
    assert all(torch.equal(a, b) for a, b in zip(params, uninterrupted, strict=True))
