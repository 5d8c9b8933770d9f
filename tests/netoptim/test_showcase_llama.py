"""The Llama showcase end to end at a tiny size: a model directory written shard by shard, trained
layer-wise from its shards against an out-of-core node with 8-bit moments."""

from __future__ import annotations

import json

from netoptim.benchmarks.showcase_llama import main


def test_a_tiny_llama_trains_from_its_shards_against_an_out_of_core_node(tmp_path, capsys):
    args = ["--model-dir", str(tmp_path / "model"), "--state-dir", str(tmp_path / "state"), "--memory-budget", "64MiB", "--steps", "2"]
    args += ["--layers", "2", "--hidden", "256", "--intermediate", "512", "--heads", "4", "--kv-heads", "2", "--vocab", "512"]
    assert main(args) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{\n") :])  # after the steps' one-line reports
    # embeddings and head 2 x 512 x 256, a final norm; per layer q, o 256 x 256, k, v 256 x 128 (2
    # key-value heads), gate, up, down 256 x 512, two norms
    per_layer = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512 + 2 * 256
    assert report["moments"] == "8bit" and report["params"] == 2 * 512 * 256 + 256 + 2 * per_layer
    assert len(report["steps"]) == 2 and report["steps"][1]["loss"] < report["steps"][0]["loss"]
    assert len(list((tmp_path / "model").glob("*.safetensors"))) >= 1 and (tmp_path / "model" / "config.json").exists()
