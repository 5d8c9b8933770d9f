"""``netoptim bench ... --plot``: charts drawn from each mode's JSON (results of real runs, trimmed),
and a clear refusal where matplotlib is missing, before any benchmark runs."""

from __future__ import annotations

import argparse
import builtins

import pytest

from netoptim.benchmarks import run_benchmark
from netoptim.benchmarks.plot import bars_of, plot_result

STEP = {
    "benchmark": "step", "ratio": 0.664, "numel": 1048576,
    "results": [{"buckets": 64, "bucket_numel": 16384, "step_s": 0.0828}, {"buckets": 1024, "bucket_numel": 1024, "step_s": 0.1247, "ms_per_bucket": 0.0436}],
}  # fmt: skip
OPTIMIZER = {
    "benchmark": "optimizer", "ratio": 0.697, "numel": 4194304, "node_mparams_per_s": 1012.7, "torch_fused_adamw_mparams_per_s": 1608.0,
    "node_bandwidth_bound_mparams_per_s": 1213.4, "fused_adamw_bandwidth_bound_mparams_per_s": 1386.7,
}  # fmt: skip
MORPH = {"benchmark": "morph", "ratio": 0.86, "median_step_s": 0.0122, "morph_pauses_s": {"5": 0.0142, "7": 0.0030, "9": 0.0082}}
TRAIN = {"benchmark": "train", "ratio": 0.98, "ddp": {"tokens_per_s": 3100.0}, "full": {"tokens_per_s": 2950.0}, "layerwise": {"tokens_per_s": 3040.0}}


@pytest.mark.parametrize(("mode", "result"), [("step", STEP), ("optimizer", OPTIMIZER), ("morph", MORPH), ("train", TRAIN)])
def test_each_mode_draws_its_comparison(tmp_path, mode, result):
    path = plot_result(mode, result, tmp_path / f"{mode}.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_the_bars_name_what_they_compare():
    assert bars_of("step", STEP)[:2] == (["64 buckets: step_s", "1024 buckets: step_s"], [0.0828, 0.1247])
    assert bars_of("train", TRAIN)[0] == ["ddp: tokens_per_s", "full: tokens_per_s", "layerwise: tokens_per_s"]
    assert bars_of("morph", MORPH)[0] == ["median step", "morph at step 5", "morph at step 7", "morph at step 9"]
    with pytest.raises(ValueError, match="no figure to draw"):
        bars_of("optimizer", {"ratio": 1.0})


def test_without_matplotlib_plot_is_refused_before_the_benchmark_runs(monkeypatch, capsys):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    status = run_benchmark(argparse.Namespace(bench="optimizer", plot="out.png"))  # would take seconds if it ran
    assert status == 2 and "pip install 'netoptim-train[plot]'" in capsys.readouterr().err
