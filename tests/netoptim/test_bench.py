"""The benchmarks run end to end and report their figures (tiny sizes: this checks the code, not speed)."""

from __future__ import annotations

import json
import subprocess
import sys


def bench(*args: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "netoptim", "bench", *args], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def test_optimizer_bench_reports_a_ratio():
    report = bench("optimizer", "--numel", str(2 << 20), "--repeats", "1", "--wire-dtype", "bfloat16")
    assert report["benchmark"] == "optimizer" and report["numel"] == 2 << 20
    assert report["ratio"] > 0 and report["node_mparams_per_s"] > 0 and report["torch_fused_adamw_mparams_per_s"] > 0
    assert report["node_bytes_per_param"] == 2 * 2 + 4 * 2 + 28 + 6


def test_transport_bench_reports_a_ratio():
    report = bench("transport", "--bytes", "8MiB", "--bucket-bytes", "1MiB", "--repeats", "1", "--curve")
    assert report["benchmark"] == "transport" and report["bytes"] == 8 << 20
    assert report["ratio"] > 0 and report["netoptim_push_pull_gbs"] > 0 and report["plain_socket_gbs"] > 0
    assert report["netoptim_curve_push_pull_gbs"] > 0 and report["curve_ratio"] > 0
