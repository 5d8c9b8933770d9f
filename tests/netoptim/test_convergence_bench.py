"""``netoptim bench convergence``: the GPT recipe (and a small transformers Llama) trained with each
moment format against real nodes (tiny here: this checks the report, not the convergence), its flags
checked, its curves drawn."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from netoptim.benchmarks.convergence_bench import curve, final_loss, run
from netoptim.benchmarks.plot import plot_result

TINY = ["--steps", "20", "--seeds", "1", "--window", "5", "--n-layer", "1", "--n-embd", "64", "--block-size", "32"]


def test_a_tiny_run_reports_each_setting_against_fp32():
    result = subprocess.run(
        [sys.executable, "-m", "netoptim", "--no-progress", "bench", "convergence", *TINY, "--moments", "8bit,fp32"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["benchmark"] == "convergence" and report["steps"] == 20 and report["seeds"] == [0] and report["window"] == 5
    assert list(report["settings"]) == ["fp32", "8bit"], "fp32 first: the baseline"
    fp32, compressed = report["settings"]["fp32"], report["settings"]["8bit"]
    assert fp32["ratio"] == 1.0 and fp32["within_1pct"] is True
    for entry in (fp32, compressed):
        assert set(entry) == {"final_loss", "median_final_loss", "ratios", "ratio", "within_1pct", "within_1pct_per_seed", "seconds"}
        assert len(entry["final_loss"]) == len(entry["ratios"]) == len(entry["within_1pct_per_seed"]) == 1
        assert 0 < entry["median_final_loss"] < 5.6, "below the loss of a uniform guess over 256 bytes (5.55) after 20 steps"
    assert compressed["ratio"] == pytest.approx(compressed["final_loss"][0] / fp32["final_loss"][0], abs=1e-4)
    assert compressed["within_1pct"] == (abs(compressed["ratio"] - 1) <= 0.01)
    assert compressed["final_loss"] != fp32["final_loss"], "8-bit moments round: not the fp32 run"
    assert report["ratio"] == pytest.approx(1 / compressed["ratio"], rel=1e-4)
    assert report["curve_every"] == 1 and [len(report["curves"][m]) for m in ("fp32", "8bit")] == [20, 20]
    assert report["curves"]["fp32"][0] == pytest.approx(report["curves"]["8bit"][0], abs=1e-4), "the same first step: same seed, same data"
    assert report["model"]["name"] == "gpt" and report["model"]["n_embd"] == 64


def test_a_tiny_llama_run_reports_the_transformers_model():
    pytest.importorskip("transformers")
    tiny = ["--steps", "10", "--seeds", "1", "--window", "5", "--n-layer", "1", "--n-embd", "64", "--block-size", "32"]
    result = subprocess.run(
        [sys.executable, "-m", "netoptim", "--no-progress", "bench", "convergence", "--model", "llama", *tiny, "--moments", "fp32,8bit"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    model = report["model"]
    assert model["name"] == "llama" and model["class"] == "transformers.LlamaForCausalLM" and model["recipe"] == "netoptim.recipes.train_hf_llama"
    assert (model["n_layer"], model["n_embd"], model["n_head"], model["n_kv_head"], model["intermediate_size"]) == (1, 64, 4, 2, 256)
    assert list(report["settings"]) == ["fp32", "8bit"] and report["steps"] == 10
    fp32, compressed = report["settings"]["fp32"], report["settings"]["8bit"]
    for entry in (fp32, compressed):
        assert 0 < entry["median_final_loss"] < 5.6, "below the loss of a uniform guess over 256 bytes (5.55) after 10 steps"
    assert compressed["final_loss"] != fp32["final_loss"], "the MLP's matrices (64 x 256) keep 8-bit moments: not the fp32 run"
    assert report["curves"]["fp32"][0] == pytest.approx(report["curves"]["8bit"][0], abs=1e-4), "the same first step: same seed, same data"


def test_llama_shapes_and_a_missing_transformers_are_refused(monkeypatch):
    llama = dict(moments=["fp32"], model="llama", n_embd=64, n_head=4, n_kv_head=2, intermediate_size=0, global_batch=0, workers=2)
    with pytest.raises(ValueError, match="not a multiple of --n-kv-head 3"):
        run(argparse.Namespace(**(llama | {"n_kv_head": 3})))
    with pytest.raises(ValueError, match="is odd: rotary embeddings"):
        run(argparse.Namespace(**(llama | {"n_embd": 36})))
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    with pytest.raises(ValueError, match=r"needs the package 'transformers'.*pip install 'netoptim-train\[integrations\]'"):
        run(argparse.Namespace(**llama))


def test_settings_without_fp32_are_refused():
    args = argparse.Namespace(moments=["8bit", "bf16"], n_embd=64, n_head=4, global_batch=0, workers=2)
    with pytest.raises(ValueError, match="the ratios are over fp32 moments; include fp32"):
        run(args)
    with pytest.raises(ValueError, match="not a multiple of --n-head"):
        run(argparse.Namespace(moments=["fp32"], n_embd=66, n_head=4, global_batch=0, workers=2))


def test_final_loss_and_curves():
    assert final_loss([4.0, 3.0, 2.0, 1.0], 2) == 1.5 and final_loss([2.0], 20) == 2.0
    assert curve([4.0, 2.0, 3.0, 1.0, 5.0], 2) == [3.0, 2.0, 5.0]
    with pytest.raises(ValueError, match="trained no step"):
        final_loss([], 20)


def test_the_plot_draws_the_loss_curves(tmp_path):
    result = {
        "benchmark": "convergence", "steps": 200, "seeds": [0], "ratio": 0.998, "curve_every": 4,
        "settings": {"fp32": {"ratio": 1.0}, "8bit": {"ratio": 1.002}},
        "curves": {"fp32": [5.5 - 0.05 * i for i in range(50)], "8bit": [5.5 - 0.0499 * i for i in range(50)]},
    }  # fmt: skip
    path = plot_result("convergence", result, tmp_path / "convergence.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
