"""The benchmarks run end to end and report their figures (tiny sizes: this checks the code, not speed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.transport.availability import requires_mooncake


def bench(*args: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "netoptim", "bench", *args], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def test_optimizer_bench_reports_a_ratio():
    report = bench("optimizer", "--numel", str(3 << 19), "--bucket-numel", str(1 << 20), "--repeats", "1", "--wire-dtype", "bfloat16")
    assert report["benchmark"] == "optimizer" and report["numel"] == 3 << 19 and report["buckets"] == 2  # a whole bucket, then the rest
    assert report["ratio"] > 0 and report["node_mparams_per_s"] > 0 and report["torch_fused_adamw_mparams_per_s"] > 0
    assert report["node_bytes_per_param"] == 4 * 6 + 2  # the frames just landed: read from the cache
    assert report["node_bytes_per_param_cold_frames"] == 2 * 2 + 4 * 6 + 2
    assert report["ratio_cold_frames"] > 0 and report["node_cold_frames_mparams_per_s"] > 0
    assert "moments" not in report  # fp32 moments: the report as before the option


@pytest.mark.parametrize(
    ("moments", "moment_bytes"),
    [("8bit", 1 + 4 / 256), ("bf16", 2)],  # per moment and parameter: a code and its share of the block's scale, or a bf16 value
)
def test_optimizer_bench_times_the_update_of_compressed_moments(moments, moment_bytes):
    report = bench("optimizer", "--moments", moments, "--numel", str(3 << 19), "--bucket-numel", str(1 << 20), "--repeats", "1")
    assert report["benchmark"] == "optimizer" and report["moments"] == moments and report["buckets"] == 2
    assert report["moment_block"] == (256 if moments == "8bit" else None)
    assert report["ratio"] > 0 and report["ratio_over_fp32_moments"] > 0 and isinstance(report["compiled_loop"], bool)
    assert report["node_mparams_per_s"] > 0 and report["torch_fused_adamw_mparams_per_s"] > 0
    # the parameter read and written, two fp32 gradients read, both moments read and written as stored
    assert report["bytes_per_param"] == 8 + 2 * 4 + 4 * moment_bytes
    assert report["state_bytes_per_param"] == 4 + 2 * moment_bytes and report["fused_adamw_bytes_per_param"] == 28


def test_optimizer_bench_refuses_buckets_that_would_keep_fp32_moments():
    result = subprocess.run(
        [sys.executable, "-m", "netoptim", "bench", "optimizer", "--moments", "8bit", "--numel", "100000", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "a bucket of 100000 elements would keep fp32 moments" in result.stderr and result.stdout == ""


def test_rule_bench_reports_a_ratio_against_the_torch_optimizer_of_its_rule():
    import argparse

    from netoptim.benchmarks.node.rule_bench import run

    for rule, baseline in (("sgd-nesterov", "SGD"), ("lion", "AdamW")):
        report = run(argparse.Namespace(rule=rule, numel=3 << 19, bucket_numel=1 << 20, workers=2, wire_dtype="bfloat16", repeats=1))
        assert report["rule"] == rule and report["ratio"] > 0 and baseline in report["baseline"]
        assert report["numel"] == 3 << 19 and report["buckets"] == 2
    with pytest.raises(ValueError, match="compressed moments are measured with --rule adamw"):
        run(argparse.Namespace(rule="lion", moments="8bit", numel=3 << 19, bucket_numel=1 << 20, workers=2, wire_dtype="float32", repeats=1))


@pytest.mark.slow  # ~12 s: four transfers with CURVE and same-host windows; tests/transport covers each path
def test_transport_bench_reports_a_ratio():
    report = bench("transport", "--bytes", "8MiB", "--bucket-bytes", "1MiB", "--repeats", "1", "--curve")
    assert report["benchmark"] == "transport" and report["bytes"] == 8 << 20
    assert report["ratio"] > 0 and report["netoptim_push_pull_gbs"] > 0 and report["plain_socket_gbs"] > 0
    assert report["netoptim_curve_push_pull_gbs"] > 0 and report["curve_ratio"] > 0 and report["same_host_ratio"] > 0


@requires_mooncake
def test_transport_bench_over_mooncake_moves_the_bytes_by_one_sided_writes():
    report = bench("transport", "--backend", "mooncake", "--bytes", "8MiB", "--bucket-bytes", "1MiB", "--repeats", "1")
    assert report["backend"] == "mooncake" and report["ratio"] > 0 and report["netoptim_push_pull_gbs"] > 0
    counted = report["client_bytes"]
    assert counted["written_bytes"] + counted["inline_bytes"] == 2 * (8 << 20)  # a warm-up round and one timed round
    assert counted["written_bytes"] >= 8 << 20  # everything after the first message went one-sided


@pytest.mark.slow  # four training modes in processes of their own: ~25 s
def test_train_bench_compares_ddp_full_and_layerwise():
    report = bench("train", "--sizes", "small", "--steps", "1", "--warmup", "0", "--batch", "1", "--seq", "16")
    entry = report["sizes"]["small"]
    assert report["ratio"] == entry["layerwise_over_ddp_tokens"] > 0
    for mode in ("ddp", "full", "layerwise"):
        assert entry[mode]["tokens_per_s"] > 0 and entry[mode]["peak_rss_mb_per_worker"] > entry[mode]["rss_after_import_mb"] > 0
    assert 0.0 <= entry["layerwise"]["comm_hidden_fraction"] <= 1.0 and entry["layerwise"]["peak_param_mb"] > 0
    assert entry["layerwise"]["fetched_mb_per_step"] > 0
    assert entry["compute"]["tokens_per_s"] > 0 and "node_cpu_s_per_step" not in entry["compute"]
    assert entry["full"]["peak_rss_mb_per_node"] > 0 and entry["layerwise"]["peak_rss_mb_per_node"] > 0
    assert entry["layerwise"]["node_cpu_s_per_step_by_thread"][0]["main"] > 0, "the serve loop's CPU, by thread"  # a step of 1.7 s
    # each node's update path as its admin service says it (one step of a small model: the trial has not ended)
    for mode in ("full", "layerwise"):
        assert len(entry[mode]["node_update_paths"]) == 1 and entry[mode]["node_update_paths"][0].startswith(("compiled", "torch-ops")), entry[mode]
    assert entry["layerwise_over_compute_only_tokens"] == entry["layerwise"]["tokens_per_s"] / entry["compute"]["tokens_per_s"]


def test_offload_bench_compares_with_the_disk(tmp_path):
    report = bench("offload", "--numel", str(4 << 20), "--bucket-numel", str(1 << 18), "--repeats", "1", "--state-dir", str(tmp_path))
    assert report["benchmark"] == "offload" and report["ratio"] > 0
    assert report["bytes_read_per_step"] == report["bytes_written_per_step"] == report["state_bytes"], "out of core: every byte read and written once"
    assert report["disk_read_gbs"] > 0 and report["disk_write_gbs"] > 0 and report["in_memory_mparams_per_s"] > 0


def test_offload_bench_compares_compressed_moments_with_fp32_ones(tmp_path):
    args = ("--numel", str(2 << 20), "--bucket-numel", str(1 << 18), "--repeats", "1", "--state-dir", str(tmp_path))
    report = bench("offload", "--moments", "8bit", *args)
    assert report["benchmark"] == "offload" and report["moments"] == "8bit" and report["moment_block"] == 256
    assert report["ratio"] > 0 and report["fp32_moments_mparams_per_s"] > 0 and report["compressed_moments_mparams_per_s"] > 0
    assert 0 < report["compressed_moments_disk_bytes_per_step"] < report["fp32_moments_disk_bytes_per_step"]
    assert report["disk_bytes_ratio"] < 0.7, "8 bits: 6 bytes of state a parameter against 12"
    assert report["compressed_moments_state_bytes"] == (4 + 2 * (1 + 4 / 256)) * (2 << 20)
    assert report["memory_budget"] == 12 * (2 << 20) // 4  # a quarter of the state with fp32 moments, for both


def test_step_bench_reports_phases_and_the_cost_of_a_bucket():
    report = bench("step", "--numel", str(1 << 20), "--buckets", "8,64", "--steps", "2", "--warmup", "1")
    assert report["benchmark"] == "step" and report["ratio"] > 0
    fewest, most = report["results"]
    assert (fewest["buckets"], most["buckets"]) == (8, 64) and "ms_per_bucket" in most
    for result in report["results"]:
        assert result["step_s"] > 0 and result["worker"]["gather_s"] > 0 and result["worker"]["install_s"] > 0
        assert result["node"]["update_s"] > 0 and result["node"]["wall_s"] > 0
        assert result["send_buffers_allocated_after_warmup"] >= 0 and result["install_vs_memcpy"] > 0 and result["install_vs_machine_memcpy"] > 0
        assert result["node_update_path"].split(" ")[0] in ("compiled", "torch-ops")  # timed once the node's start-up is over
        by_thread = result["node_cpu_s_per_step_by_thread"]  # 10 ms ticks: a group may have used none in two small steps
        assert all(isinstance(name, str) and seconds > 0 for name, seconds in by_thread.items()), by_thread


def test_train_bench_gives_each_node_its_own_state_directory(tmp_path):
    import argparse

    from netoptim.benchmarks.train_bench import node_flags

    args = argparse.Namespace(same_host_board=False, out_of_core=64 << 20, node_arg=["--pass-thread"])
    flags = [node_flags(args, tmp_path / f"node{i}-state") for i in range(2)]
    assert flags[0] == ("--no-same-host-board", "--state-dir", str(tmp_path / "node0-state"), "--memory-budget", str(64 << 20), "--pass-thread")
    assert flags[1][2] == str(tmp_path / "node1-state")  # a node clears the state files it finds: never two in one directory
    assert node_flags(argparse.Namespace(same_host_board=None, out_of_core=None, node_arg=[]), tmp_path) == ()  # the node's default
    assert node_flags(argparse.Namespace(same_host_board=True, out_of_core=1 << 30, node_arg=[]), tmp_path)[0] == "--same-host-board"  # out of core too


def test_train_bench_rounds_report_the_median_round_and_median_ratios():
    from netoptim.benchmarks.train_bench import _median_ratio, _median_round

    ddp = [{"tokens_per_s": rate, "round": i} for i, rate in enumerate((100.0, 300.0, 200.0))]
    layerwise = [{"tokens_per_s": rate, "round": i} for i, rate in enumerate((110.0, 240.0, 260.0))]
    assert _median_round(ddp) == {"tokens_per_s": 200.0, "round": 2, "tokens_per_s_rounds": [100.0, 300.0, 200.0]}
    assert _median_round([{"status": "skipped: too large"}] * 2) == {"status": "skipped: too large"}
    assert _median_round(ddp[:2])["round"] == 0  # an even count: the lower middle round
    # each round's ratio (1.1, 0.8, 1.3), then their median; not 240 / 200
    assert _median_ratio({"layerwise": layerwise, "ddp": ddp}, "layerwise", "ddp") == 1.1


def test_a_state_directory_that_several_nodes_would_share_is_refused():
    from netoptim.benchmarks.common import check_node_args

    check_node_args(["--state-dir=/scratch", "--memory-budget=1GiB"], 1)  # one node: its own
    check_node_args(["--pass-thread"], 4)
    with pytest.raises(ValueError, match="all 2 local nodes one state directory"):
        check_node_args(["--state-dir", "/scratch"], 2)
    with pytest.raises(ValueError, match="use --out-of-core BUDGET"):
        check_node_args(["--state-dir=/scratch"], 1, own_directories="--out-of-core BUDGET")


def test_a_bench_setting_that_cannot_run_is_a_usage_error():
    result = subprocess.run(
        [sys.executable, "-m", "netoptim", "bench", "train", "--sizes", "small", "--node-arg=--state-dir=unused"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "netoptim bench train: --node-arg=--state-dir: use --out-of-core BUDGET" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
