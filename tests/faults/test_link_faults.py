"""Link faults between the workers and the node, put there by a userspace TCP proxy
(:mod:`tests.faults.proxy`): the workers are given the proxy's address and told to stay on it
(``--no-same-host``, else they would move to the node's ipc socket after HELLO), and each case checks
the proxy's byte counters, so the traffic really crossed the faulty link. Each case ends bitwise where
an uninterrupted run ends.

Faults start at a seeded point of the traffic (a number of bytes from the node), not at a time, so a
trial does the same on a slow machine as on a fast one."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from tests.faults.harness import STEPS, TRIALS, WORLD, Job, bitwise_equal
from tests.faults.proxy import LinkProxy

pytestmark = pytest.mark.faults


def bytes_from_node_per_run() -> int:
    """About what the node sends the workers in a run: every parameter, fp32, to each rank, after the
    connection and after each step."""
    import torch

    from gpu_worker.models import GPT
    from tests.faults.worker_program import CONFIG

    with torch.device("meta"):
        numel = sum(p.numel() for p in GPT(CONFIG).parameters())
    return numel * 4 * WORLD * (STEPS + 1)


def at_traffic(proxy: LinkProxy, fraction: float, action: Callable[[], None]) -> threading.Thread:
    """Run ``action`` once the node has sent ``fraction`` of a run's bytes through ``proxy``."""
    threshold = int(fraction * bytes_from_node_per_run())

    def watch() -> None:
        while proxy.bytes_down < threshold:
            if watcher.finished:
                return
            time.sleep(0.002)
        action()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.finished = False  # type: ignore[attr-defined]
    watcher.start()
    return watcher


@pytest.fixture
def proxied_job(tmp_path) -> Iterator[tuple[Job, LinkProxy]]:
    """A node, a proxy in front of it, and workers told to stay on the proxy's address."""
    job = Job(tmp_path, worker_args=("--no-same-host",))
    node = job.start_node()
    host, port = node.address.removeprefix("tcp://").rsplit(":", 1)
    proxy = LinkProxy((host, int(port)), seed=tmp_path.name).start()
    job.worker_nodes = proxy.address
    try:
        yield job, proxy
    finally:
        proxy.close()
        job.close()


def run_through(job: Job, proxy: LinkProxy, reference: dict, *watchers: threading.Thread) -> None:
    """Start both ranks, wait for them, and check the result and that it came through the proxy."""
    for rank in range(WORLD):
        job.start_worker(rank)
    try:
        for rank in range(WORLD):
            assert job.wait(rank) == 0, job.logs()
    finally:
        for watcher in watchers:
            watcher.finished = True  # type: ignore[attr-defined]
    assert proxy.bytes_up > 0 and proxy.bytes_down >= bytes_from_node_per_run() // 2, (proxy.bytes_up, proxy.bytes_down)
    assert "same host" not in job.logs(), "a worker left the proxy for the node's ipc socket"
    difference = bitwise_equal(job.result(), reference["full"])
    assert difference == 0.0, f"parameters differ by {difference}\n{job.logs()}"


@pytest.mark.slow  # every message waits 20 ms each way: ~40 s
@pytest.mark.parametrize("seed", range(TRIALS))
def test_a_20ms_delay_each_way_changes_nothing(proxied_job, reference, seed):
    """Latency alone (20 ms per chunk each way, so every message waits at least 40 ms for its answer)
    only slows the job down."""
    job, proxy = proxied_job
    proxy.delay_s = 0.020
    run_through(job, proxy, reference)


@pytest.mark.slow  # 35 s: resets at random moments cover the reconnect path by default
@pytest.mark.parametrize("seed", range(TRIALS))
def test_a_10s_partition_mid_run_is_ridden_out(proxied_job, reference, seed):
    """Nothing crosses the link for 10 s (the workers' ``silent_after_s``): the workers ping, may take
    the node for gone and reconnect through the same link, and continue bitwise once it heals."""
    job, proxy = proxied_job
    rng = random.Random(f"partition-{seed}")
    began: list[float] = []
    watcher = at_traffic(proxy, rng.uniform(0.15, 0.8), lambda: (began.append(time.monotonic()), proxy.partition(10.0)))
    run_through(job, proxy, reference, watcher)
    assert began, "the partition never started"


@pytest.mark.parametrize("seed", range(TRIALS))
def test_connections_reset_at_random_moments_are_survived(proxied_job, reference, seed):
    """Every connection is reset (RST, bytes in flight lost) at two seeded points of the traffic; ZeroMQ
    reconnects underneath, and the workers must notice what was lost and ask or push again."""
    job, proxy = proxied_job
    job.worker_timeout_s = 10.0  # a wait that never ends would be the failure: fail it soon
    rng = random.Random(f"reset-{seed}")
    watchers = [at_traffic(proxy, fraction, proxy.reset_all) for fraction in sorted(rng.uniform(0.1, 0.9) for _ in range(2))]
    run_through(job, proxy, reference, *watchers)
    assert proxy.resets >= 1, "no connection was reset"
