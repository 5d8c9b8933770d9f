"""The node's Prometheus metrics (prometheus_client): a registry per node with process metrics, the
step, step time and update histograms, byte counters, paused/draining, workers heard from recently
(falls when a worker is gone) and checkpoint age, scraped over HTTP from a real node subprocess."""

from __future__ import annotations

import math
import time
import urllib.request

import grpc
import pytest
import torch

from gpu_worker import RemoteAdamW
from optimizer_node.control import StepTimings
from optimizer_node.metrics import WORKER_SILENT_AFTER_S, NodeMetrics, worker_silent_after_s
from protos import admin_pb2, admin_pb2_grpc

STEPS = 3


def scrape(url: str) -> dict[str, float]:
    """Every sample of the exposition at ``url``: ``name{labels}`` -> value."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in text.splitlines() if line and not line.startswith("#"))}


def wait_for(url: str, name: str, wanted: float, timeout_s: float = 10.0) -> dict[str, float]:
    """Scrape until ``name`` reads ``wanted``; the last scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = scrape(url)
        if values.get(name) == wanted or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def test_registries_are_per_node_and_scrape_time_series_follow_the_state():
    """Two nodes in one process register the same names on registries of their own; workers, paused,
    draining and checkpoint age are read from the callables at each scrape."""
    now = time.time()
    seen = {0: now, 1: now - 10.0}
    paused, checkpoint = [False], [None]
    first = NodeMetrics(workers_last_seen=lambda: list(seen.values()), paused=lambda: paused[0], last_checkpoint_unix=lambda: checkpoint[0], silent_after_s=5.0)
    second = NodeMetrics(silent_after_s=5.0)
    first.received(100)
    first.step_completed(StepTimings(wall_s=0.2, reduce_s=0.05, update_s=0.1, send_s=0.05), 7)
    text = first.render().decode()
    assert "netoptim_workers_connected 1.0" in text and "netoptim_paused 0.0" in text and "netoptim_draining 0.0" in text
    assert "netoptim_checkpoint_age_seconds" not in text  # absent before the first checkpoint
    assert "netoptim_step 7.0" in text and 'netoptim_step_duration_seconds_bucket{le="0.25"} 1.0' in text
    assert "process_resident_memory_bytes" in text and "python_info" in text
    paused[0], checkpoint[0] = True, time.time() - 30.0
    seen[1] = time.time()
    text = first.render().decode()
    assert "netoptim_workers_connected 2.0" in text and "netoptim_paused 1.0" in text
    age = float(next(line for line in text.splitlines() if line.startswith("netoptim_checkpoint_age_seconds ")).split()[1])
    assert 30.0 <= age < 40.0
    other = second.render().decode()
    assert "netoptim_bytes_received_total 0.0" in other and "netoptim_step 0.0" in other and "netoptim_workers_connected 0.0" in other


def test_worker_silence_threshold_from_the_environment(monkeypatch):
    monkeypatch.setenv("NETOPTIM_METRICS_WORKER_SILENT_S", "2.5")
    assert worker_silent_after_s() == 2.5
    for bad in ("0", "-1", "nan", "soon"):
        monkeypatch.setenv("NETOPTIM_METRICS_WORKER_SILENT_S", bad)
        assert worker_silent_after_s() == WORKER_SILENT_AFTER_S


def test_metrics_of_a_training_node(start_node, tmp_path):
    """Train a tiny model against a real node, then scrape: process metrics, the step, the histograms,
    bytes, paused 0 (1 while paused), checkpoint age after a checkpoint, and the worker count falling
    back to 0 once the worker closed (its BYE; silence is the unit test's above, and the default
    threshold keeps a scrape that waits behind the step's checkpoint on a busy machine from missing
    the worker that just trained)."""
    checkpoints = tmp_path / "checkpoints"
    node = start_node(extra_args=("--metrics-port", "0", "--admin", "127.0.0.1:0", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1"))
    before = scrape(node.metrics_url)
    assert before["netoptim_workers_connected"] == 0 and before["netoptim_step"] == 0 and "netoptim_checkpoint_age_seconds" not in before

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)  # 8 KiB of weights: through the same-host shared windows
    opt = RemoteAdamW(model.parameters(), lr=0.1, nodes=[node.address], rank=0, world_size=1)
    for _ in range(STEPS):
        model(torch.ones(2, 64)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    values = scrape(node.metrics_url)
    assert values["netoptim_workers_connected"] == 1
    assert values["process_resident_memory_bytes"] > 0 and values["process_cpu_seconds_total"] > 0
    assert values["netoptim_step"] == STEPS and values["netoptim_steps_total"] == STEPS
    assert values['netoptim_step_duration_seconds_bucket{le="+Inf"}'] == STEPS and values["netoptim_step_duration_seconds_count"] == STEPS
    assert values['netoptim_bucket_update_latency_seconds_bucket{le="+Inf"}'] == STEPS
    assert values["netoptim_bytes_received_total"] > 0 and values["netoptim_bytes_sent_total"] > 0
    assert values["netoptim_paused"] == 0 and values["netoptim_draining"] == 0
    assert 0 <= values["netoptim_checkpoint_age_seconds"] < 30 and not math.isnan(values["netoptim_checkpoint_age_seconds"])
    assert values['netoptim_non_finite_policy{policy="refuse"}'] == 1 and values["netoptim_non_finite_refused_total"] == 0
    assert values["netoptim_same_host_windows"] == 1
    assert values["netoptim_same_host_shared_bytes_received_total"] >= STEPS * 64 * 32 * 4, "the pushes came through the worker's window"
    assert values["netoptim_same_host_shared_bytes_sent_total"] >= STEPS * 64 * 32 * 4, "the new values went through it"
    assert values["netoptim_same_host_board_bytes"] > 0, "the job has a parameter board"
    # a bucket this small travels in the batches of small buckets after each step, which are copies: the board had the values pulled alone
    assert values["netoptim_same_host_board_referenced_bytes_total"] >= 64 * 32 * 4, "values were read from the board"
    assert values["netoptim_same_host_board_written_bytes_total"] >= 64 * 32 * 4
    assert values["netoptim_state_read_bytes_total"] == values["netoptim_state_written_bytes_total"] == 0, "the state is in memory"

    with grpc.insecure_channel(node.admin_address) as channel:
        admin = admin_pb2_grpc.OptimizerNodeAdminStub(channel)
        admin.Pause(admin_pb2.PauseRequest(reason="metrics test"), timeout=10)
        assert scrape(node.metrics_url)["netoptim_paused"] == 1
        admin.Resume(admin_pb2.ResumeRequest(), timeout=10)
    assert scrape(node.metrics_url)["netoptim_paused"] == 0

    opt.close()
    values = wait_for(node.metrics_url, "netoptim_workers_connected", 0)
    assert values["netoptim_workers_connected"] == 0, "the closed worker still counts as connected"
    values = wait_for(node.metrics_url, "netoptim_same_host_windows", 0)  # its BYE and its windows' close come on two sockets, in either order
    assert values["netoptim_step"] == STEPS and values["netoptim_same_host_windows"] == 0, "a closed worker's windows are freed"


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
