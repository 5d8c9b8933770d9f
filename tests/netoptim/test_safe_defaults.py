"""A node whose state a crash would lose says so: once at start, in its status and in a metric;
``plan-memory`` counts the checkpoints the node keeps by default."""

from __future__ import annotations

import urllib.request

import grpc
import pytest

from netoptim.cli.job_size_args import DEFAULTS
from optimizer_node.config import NodeConfig
from protos import admin_pb2, admin_pb2_grpc

CASES = {
    "no checkpoints": ((), "a crash of this node loses the job's fp32 masters and optimizer state for good", 1),
    "on request only": (("--checkpoint-dir", "{tmp}/ckpt"), "a crash loses every step since the last one", 1),
    "periodic": (("--checkpoint-dir", "{tmp}/ckpt", "--checkpoint-every", "10"), "", 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_node_says_what_a_crash_would_lose(start_node, tmp_path, case):
    flags, warning, metric = CASES[case]
    extra = tuple(flag.format(tmp=tmp_path) for flag in flags)
    node = start_node(extra_args=(*extra, "--admin", "127.0.0.1:0", "--metrics-port", "0"))
    log = node.log_text()
    if warning:
        assert log.count(warning) == 1, log[-3000:]  # said once, at start
        assert "--checkpoint-every N" in log
    else:
        assert "a crash" not in log
    with grpc.insecure_channel(node.admin_address) as channel:
        status = admin_pb2_grpc.OptimizerNodeAdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
    assert (warning in status.state_at_risk) if warning else status.state_at_risk == ""
    scraped = urllib.request.urlopen(node.metrics_url, timeout=10).read().decode()
    assert f"netoptim_state_at_risk {float(metric)}" in scraped


def test_plan_memory_counts_the_checkpoints_the_node_keeps_by_default():
    assert DEFAULTS["keep"] == NodeConfig(listen="tcp://127.0.0.1:0").keep
