"""Cluster step predictions: the bytes they count (rings cross a host's link once), link
efficiencies recovered from a report, and ``netoptim plan --cluster``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpu_worker.models import GPTConfig
from netoptim.cluster.prediction import CalibrationError, efficiencies_from_reports, predict_cluster, prediction_bytes
from netoptim.cluster.report import Shape, model_link_bytes
from netoptim.cluster.scaling import param_count
from netoptim.planning.cluster_model import ClusterTiming
from tests.cli import run_netoptim

CONFIG = GPTConfig(n_layer=2, n_embd=128, n_head=4, block_size=64)


def test_rings_cross_a_hosts_link_once_and_netoptim_sends_one_flow_per_host():
    shape = Shape(2, 2, 1)
    params = param_count(CONFIG)
    upper = model_link_bytes("fsdp", CONFIG, params, shape)
    ring = prediction_bytes("fsdp", CONFIG, shape)
    assert ring["w0"] == pytest.approx(upper["w0"] / 2) and ring["n0"] == 0
    assert prediction_bytes("ddp", CONFIG, Shape(1, 4, 1))["w0"] == 0  # one host: nothing crosses a link
    netoptim = prediction_bytes("netoptim", CONFIG, shape)
    assert netoptim["w0"] == 4 * params and netoptim["n0"] == 2 * 4 * params


def report(shape: Shape, steps: dict[str, float], link_bit_s: float = 15e6, compute_s: float = 0.025) -> dict:
    return {
        "model": {"n_layer": 2, "n_embd": 128, "n_head": 4, "block_size": 64},
        "cluster": {"worker_hosts": shape.worker_hosts, "workers_per_host": shape.workers_per_host, "node_hosts": shape.node_hosts},
        "compute_probe_s": compute_s,
        "links": {"emulated_bit_s": link_bit_s},
        "cores": 2.0,
        "host_groups": True,
        "netoptim_bucket_numel": 58_816,
        "results": {mode: {"step_s": step} for mode, step in steps.items()},
    }


def test_efficiencies_from_a_report_reproduce_its_steps(tmp_path):
    shape = Shape(2, 1, 1)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(report(shape, {"netoptim": 3.0, "fsdp": 2.5, "ddp": 1.1})))
    efficiency = efficiencies_from_reports([path])
    assert set(efficiency) == {"netoptim/node-link", "fsdp", "ddp"} and all(0 < v <= 1 for v in efficiency.values())
    timing = ClusterTiming(compute_s=0.025, link_bit_s=15e6, ranks=2, cores=2.0, buckets=8, efficiency=efficiency)
    predicted = predict_cluster(CONFIG, shape, timing)
    assert predicted["netoptim"].step_s == pytest.approx(3.0) and predicted["fsdp"].step_s == pytest.approx(2.5)
    # a step bound by a worker host's link has no efficiency of its own here: netoptim's other one serves
    other = predict_cluster(CONFIG, Shape(2, 1, 2), ClusterTiming(compute_s=0.025, link_bit_s=15e6, ranks=2, cores=2.0, buckets=8, efficiency=efficiency))
    assert other["netoptim"].busiest_link == "w0" and other["netoptim"].communication_s > 0
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(CalibrationError, match="is not a report"):
        efficiencies_from_reports([tmp_path / "bad.json"])
    with pytest.raises(CalibrationError, match="cannot read"):
        efficiencies_from_reports([tmp_path / "missing.json"])


def test_plan_predicts_a_cluster_and_refuses_half_a_request(tmp_path):
    calibration = tmp_path / "ref.json"
    calibration.write_text(json.dumps(report(Shape(2, 1, 1), {"netoptim": 3.0, "fsdp": 2.5, "ddp": 1.1})))
    model = ["--n-layer", "2", "--n-embd", "128", "--n-head", "4", "--block-size", "64"]
    result = subprocess.run(
        [sys.executable, "-m", "netoptim", "plan", "--cluster", "4x2+2", "--link-mbit", "15", "--cluster-calibration", str(calibration), "--json", *model],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    systems = json.loads(result.stdout)["systems"]
    assert set(systems) == {"netoptim", "fsdp", "ddp"}
    assert systems["netoptim"]["busiest_link"] == "n0" and systems["netoptim"]["efficiency"] < 1
    assert all(s["predicted_step_s"] > s["predicted_communication_s"] > 0 for s in systems.values())
    for flags, message in (
        (["--cluster", "2x1+1"], "--cluster needs --link-mbit"),
        (["--link-mbit", "10"], "--link-mbit and --node-link-mbit go with --cluster"),
    ):
        refused = run_netoptim("plan", *flags)
        assert refused.returncode != 0 and message in refused.stderr
