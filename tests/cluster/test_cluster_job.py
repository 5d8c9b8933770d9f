"""A training job on the emulated cluster trains exactly as the same job on loopback."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from gpu_worker.models import GPTConfig
from netoptim.cluster import cleanup
from netoptim.cluster.report import Shape
from netoptim.cluster.runner import JobSpec, LoopbackPlacement, run_job
from netoptim.cluster.scaling import param_count
from netoptim.cluster.session import ClusterRun, auto_bucket_numel, run_cluster

requires_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the emulated cluster creates network namespaces, veths and a bridge: root only (the CI runs as root)"
)


@requires_root
@pytest.mark.slow  # two jobs with a node each, and a cluster built and removed: ~30 s
def test_smallest_cluster_job_is_bitwise_equal_to_loopback(tmp_path):
    config = GPTConfig(block_size=32, n_layer=1, n_embd=64, n_head=4)
    job = JobSpec(
        mode="netoptim", n_layer=1, n_embd=64, n_head=4, block_size=32, micro_batch=4, warmup=0, steps=3, bucket_numel=auto_bucket_numel(param_count(config))
    )
    before = set(cleanup.leftover_namespaces())
    report = run_cluster(ClusterRun(shape=Shape(1, 1, 1), job=replace(job, save_params=str(tmp_path / "cluster.pt")), emulated_mbit=50.0))
    assert set(cleanup.leftover_namespaces()) <= before, "the run left namespaces behind"
    assert not cleanup.leftover_namespaces(report["cluster"]["prefix"])
    run_job(LoopbackPlacement(1, 1), replace(job, save_params=str(tmp_path / "loopback.pt")))

    on_cluster, on_loopback = torch.load(tmp_path / "cluster.pt"), torch.load(tmp_path / "loopback.pt")
    assert list(on_cluster) == list(on_loopback)
    for name, value in on_cluster.items():
        assert torch.equal(value, on_loopback[name]), f"{name} differs between the emulated cluster and loopback"
    torch.manual_seed(0)
    from gpu_worker.models import GPT

    initial = GPT(config).state_dict()
    assert any(not torch.equal(initial[name], value) for name, value in on_cluster.items()), "the job must have trained"

    # And the bytes went over the emulated links: the worker's gradients out and parameters back.
    link = report["results"]["netoptim"]["links"]["w0"]
    params_bytes = 4 * report["model"]["params"]
    assert link["model_bytes_per_step"] == params_bytes
    assert params_bytes <= link["up_bytes_per_step"] < 1.3 * params_bytes
    assert params_bytes <= link["down_bytes_per_step"] < 1.3 * params_bytes


@requires_root
@pytest.mark.slow  # three systems trained on one emulated cluster: ~80 s
def test_bench_compares_netoptim_fsdp_and_ddp_on_the_same_links():
    import json
    import subprocess
    import sys

    tiny = ["--n-layer", "1", "--n-embd", "64", "--block-size", "32", "--micro-batch", "2", "--steps", "2", "--emulated-mbit", "50"]
    result = subprocess.run([sys.executable, "-m", "netoptim", "bench", "cluster", *tiny], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["benchmark"] == "cluster" and report["ratio"] == report["netoptim_tokens_per_s"] / report["fsdp_tokens_per_s"] > 0
    params_bytes = 4 * report["model"]["params"]
    for system in ("netoptim", "fsdp", "ddp"):
        links = report["results"][system]["links"]
        assert set(links) == {"w0", "w1", "n0"}
        assert links["w0"]["up_bytes_per_step"] >= links["w0"]["model_bytes_per_step"] > 0.4 * params_bytes
    assert report["results"]["fsdp"]["links"]["n0"]["up_bytes_per_step"] < 1000  # the baselines never touch the node host
    for system in ("netoptim", "fsdp", "ddp"):  # the step-time model's prediction sits next to each measurement
        result = report["results"][system]
        assert result["predicted_step_s"] > result["predicted_compute_s"] > 0
        assert report["prediction_errors"][system] == pytest.approx(result["predicted_step_s"] / result["step_s"] - 1)
