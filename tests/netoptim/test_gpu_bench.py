"""``netoptim bench gpu``: without CUDA it says so and exits 0; its modes train for real on whatever
device they are given (here the CPU, with real nodes), and its summary is the arithmetic it claims."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from gpu_worker.layerwise.copy_rates import copy_bandwidth_gbs
from netoptim.benchmarks.common import store_io_threads
from netoptim.benchmarks.gpu import bench as gpu_bench
from netoptim.benchmarks.gpu.limits import offload_limit_step_s
from netoptim.benchmarks.gpu.limits_file import check_same_box, load_limits
from netoptim.benchmarks.gpu.modes import ModeSettings
from netoptim.benchmarks.train_bench import param_count
from netoptim.launch.host_cpus import format_cpu_list, update_threads


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the benchmark's answer on a machine without CUDA")
def test_without_cuda_it_says_so_and_exits_zero_without_a_figure():
    result = subprocess.run([sys.executable, "-m", "netoptim", "bench", "gpu"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["benchmark"] == "gpu" and report["ratio"] is None and "no CUDA device" in report["status"]


def test_a_bad_size_is_refused_naming_the_sizes():
    result = subprocess.run([sys.executable, "-m", "netoptim", "bench", "gpu", "--sizes", "1b,2b"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "350m" in result.stderr and "7b" in result.stderr


PINNABLE = len(os.sched_getaffinity(0)) >= 2


# layer-wise (13 s) and torch alone (10 s): slow cases; the full model's case covers the benchmark's netoptim path,
# the compute case its processes and batches
@pytest.mark.parametrize("mode", ["compute", pytest.param("torch", marks=pytest.mark.slow), "full", pytest.param("layerwise", marks=pytest.mark.slow)])
def test_each_mode_trains_the_same_batches_and_reports_its_figures(mode):
    """The full model runs pinned (``--pin``) where there are two CPUs: the worker on one, its node on the others."""
    # the full model's node keeps payloads on the socket (--node-arg): nothing goes through shared memory
    args = argparse.Namespace(nodes=1, timeout_s=180, node_arg=["--same-host-window-mb=0"] if mode == "full" else [])
    # layer-wise keeps the whole model from forward to backward: each unit is fetched once a step
    settings = ModeSettings(batch=2, seq=16, warmup=1, steps=2, bucket_numel=1 << 16, keep_for_backward=1 << 30 if mode == "layerwise" else 0)
    pinned = mode == "full" and PINNABLE
    split = gpu_bench.host_split(nodes=1, node_threads=1, pin=True, worker_cpus=1) if pinned else gpu_bench.HostSplit(node_threads=1)
    report = gpu_bench.run_mode(mode, "small", "float32", settings, torch.device("cpu"), args, split)
    assert "status" not in report, report.get("status")
    assert report["step_s"] > 0 and report["tokens_per_s"] == pytest.approx(2 * 16 / report["step_s"])
    assert math.isfinite(report["loss"]) and 4 < report["loss"] < 7  # ln(256) ~ 5.5 at the start
    assert 0 < report["host_pss_mb_after_training"] <= report["peak_host_rss_mb"]
    if mode in ("full", "layerwise"):
        (node,) = report["nodes"]
        assert "compiled" in node["update_path"] or node["update_path"].startswith("torch-ops")
        assert node["last_step_s"]["wall"] > 0
        assert set(report["worker_phases_s_per_step"]) == {"gather_s", "send_s", "wait_s", "install_s"}
        shared = report["shared_memory_mb_per_step"]
        assert (shared["sent"] == shared["received"] == 0) == (mode == "full"), shared
        assert report["host_to_device_mb_per_step"] == {"direct": 0.0, "staged": 0.0}  # on a GPU: straight from windows and boards, or staged
    if mode == "layerwise":
        assert 0 <= report["comm_hidden_fraction"] <= 1
        model_mb = 4 * param_count(gpu_bench.SIZES["small"]) / 2**20
        assert report["fetched_mb_per_step"] == pytest.approx(model_mb, rel=0.01), "every parameter fetched once a step, fp32"
    if pinned:  # where each process ran, read from the processes themselves
        assert report["worker_cpus"] == format_cpu_list(split.worker_cpus) and report["node_cpus"] == [format_cpu_list(split.node_cpus[0])]


def test_the_host_split_pins_disjoint_sets_or_shares_the_cpus_the_worker_leaves():
    usable = len(os.sched_getaffinity(0))
    if PINNABLE:
        cpus = tuple(sorted(os.sched_getaffinity(0)))
        assert gpu_bench.host_split(nodes=1, node_threads=None, pin=True, worker_cpus=1) == gpu_bench.HostSplit(
            update_threads(usable - 1), (cpus[1:],), cpus[:1]
        )
    assert gpu_bench.host_split(nodes=1, node_threads=None, pin=False, worker_cpus=1) == gpu_bench.HostSplit(update_threads(max(1, usable - 1)))
    assert gpu_bench.host_split(nodes=2, node_threads=3, pin=False, worker_cpus=1).node_threads == 3
    out_of_core = gpu_bench.host_split(nodes=1, node_threads=None, pin=False, worker_cpus=1, store_io_threads=4)
    assert out_of_core.node_threads == update_threads(max(1, usable - 1), store_io_threads=4)
    with pytest.raises(ValueError, match="need"):
        gpu_bench.host_split(nodes=usable, node_threads=None, pin=True, worker_cpus=1)


@pytest.mark.parametrize(
    ("node_args", "threads"),
    [
        ((), 0),
        (("--same-host-board",), 0),
        (("--state-dir=/s", "--memory-budget=4GiB"), 4),
        (("--state-dir", "/s", "--state-io-threads=3"), 6),
        (("--state-dir=/s", "--state-io-threads", "1"), 2),
        (("--state-io-threads=3",), 0),  # in memory the flag has nothing to do
    ],
)
def test_the_bench_counts_the_store_threads_of_its_out_of_core_nodes(node_args, threads):
    assert store_io_threads(node_args) == threads


def test_a_malformed_store_thread_count_is_named():
    with pytest.raises(ValueError, match="--state-io-threads=three"):
        store_io_threads(("--state-dir=/s", "--state-io-threads=three"))


def test_a_failing_mode_is_reported_and_the_run_goes_on():
    args = argparse.Namespace(nodes=1, timeout_s=60, node_arg=[])
    report = gpu_bench.run_mode("zero2", "small", "float32", ModeSettings(batch=0), torch.device("cpu"), args, gpu_bench.HostSplit(node_threads=1))
    assert report["status"].startswith("failed: ")


def test_the_offload_limit_is_the_slowest_part_and_fractions_follow_from_it():
    limits = {"pinned_h2d_gbs": 50.0, "pinned_d2h_gbs": 40.0, "cpu_adamw_mparams_per_s": 5000.0}
    bound = offload_limit_step_s(1_000_000_000, 4, 0.15, limits)
    assert bound["d2h_s"] == pytest.approx(0.1) and bound["h2d_s"] == pytest.approx(0.08) and bound["cpu_adamw_s"] == pytest.approx(0.2)
    assert bound["offload_limit_step_s"] == pytest.approx(0.2)
    entry = {
        "compute": {"step_s": 0.15, "tokens_per_s": 6000.0},
        "full": {"step_s": 0.4, "tokens_per_s": 2000.0},
        "zero2": {"step_s": 0.8, "tokens_per_s": 1000.0},
        "layerwise": {"status": "failed: x"},
    }
    gpu_bench.summarize(entry, 1_000_000_000, "float32", limits)
    assert entry["full_over_zero2_tokens"] == pytest.approx(2.0) and "layerwise_over_zero3_tokens" not in entry
    assert entry["full_fraction_of_offload_limit"] == pytest.approx(0.5) and entry["zero2_fraction_of_offload_limit"] == pytest.approx(0.25)
    assert gpu_bench.headline({"sizes": {"1b": {"float32": entry}}}) == pytest.approx(2.0)


def test_the_largest_size_is_the_largest_every_offloaded_mode_fits():
    assert gpu_bench.largest_fitting(128 << 30, 141 << 30) == "3b"  # 7B would need ~190 GB of host memory
    assert gpu_bench.largest_fitting(512 << 30, 141 << 30) == "7b"
    assert gpu_bench.largest_fitting(16 << 30, 80 << 30) == "350m"
    assert gpu_bench.largest_fitting(1 << 30, 8 << 30) == "small"


def test_torch_alone_is_skipped_where_it_cannot_fit_the_gpu():
    assert gpu_bench._fits("torch", 7_000_000_000, "float32", 80 << 30).startswith("skipped: needs about 104 GiB")
    assert gpu_bench._fits("torch", 7_000_000_000, "bfloat16", 80 << 30) is None
    assert gpu_bench._fits("layerwise", 70_000_000_000, "float32", 80 << 30) is None


def test_the_limits_include_both_update_paths_of_the_node():
    figures = gpu_bench.measure_limits(torch.device("cpu"), 1 << 20, 1 << 20, gpu_bench.HostSplit(node_threads=1), 1 << 18)
    assert figures["node_update_compiled_mparams_per_s"] > 0 and figures["node_update_torch_ops_mparams_per_s"] > 0
    assert figures["node_update_bucket_numel"] == 1 << 18  # the pass measured in the job's buckets
    assert figures["node_update_threads"] == 1 and figures["cpu_adamw_threads"] >= 1


def test_copy_bandwidth_is_measured_each_way():
    figures = copy_bandwidth_gbs(torch.device("cpu"), nbytes=1 << 20, repeats=1)
    assert set(figures) == {"pinned_h2d_gbs", "pinned_d2h_gbs", "pageable_h2d_gbs"} and min(figures.values()) > 0


def _children(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rpartition(")")[2].split()[1]) == pid:
                        found.add(int(entry))
            except OSError:
                pass
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
def test_sigterm_stops_the_mode_running_in_its_child():
    """``timeout`` or a scheduler ends a run with SIGTERM: the mode's process goes with it, instead of
    training on alone on the GPU that the next run measures."""
    script = "import time\nfrom netoptim.benchmarks.gpu.bench import in_child, sigterm_unwinds\nwith sigterm_unwinds():\n    print('ready', flush=True)\n    in_child(time.sleep, (120,), 300)\n"
    bench = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert bench.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        children: set[int] = set()
        while time.monotonic() < deadline and len(children) < 2:  # the mode's process and multiprocessing's resource tracker
            time.sleep(0.1)
            children = _children(bench.pid)
        assert children, "the mode's process did not start"
        time.sleep(0.5)
        bench.terminate()
        assert bench.wait(timeout=30) == 128 + 15
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(pid) for pid in children):
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in children), "a child of the run outlived it"
    finally:
        bench.kill()


def test_the_table_for_people_gives_each_mode_its_ratios_and_the_nodes_last_step():
    from netoptim.benchmarks.gpu.table import table

    node = {"last_step_passes": {"seconds": 0.45, "median_ms": 1.79}, "last_step_s": {"tail": 0.37}}
    entry = {
        "zero2": {"tokens_per_s": 1261.0, "step_s": 0.812, "peak_gpu_mb": 10473.0},
        "full": {"tokens_per_s": 1581.0, "step_s": 0.647, "peak_gpu_mb": 7869.0, "nodes": [node]},
        "torch": {"status": "skipped: needs about 104 GiB"},
    }
    gpu_bench.summarize(entry, 1_008_349_184, "float32", {})
    lines = table({"sizes": {"1b": {"params": 1_008_349_184, "float32": entry}}}).splitlines()
    assert len(lines) == 4 and lines[0].split()[:4] == ["size", "dtype", "mode", "tokens/s"]
    full = next(line for line in lines if " full " in line)
    assert "1,581" in full and "1.25x" in full and "passes 0.45 s (1.79 ms a bucket), tail 0.37 s" in full
    assert any("torch" in line and "skipped: needs about 104 GiB" in line for line in lines)
    settings = {"bucket_numel": 4194304, "overlap_forward": False, "nodes": 1, "node_threads": 13, "node_args": ["--pass-thread"]}
    first = table({"settings": settings, "sizes": {}}).splitlines()[0]
    assert first == "netoptim: buckets of 4,194,304 elements, overlap_forward off, 1 node(s) of 13 update threads, node flags --pass-thread"
    settings |= {"overlap_forward": True, "keep_step_gradients": False, "keep_for_backward": 8 << 30}
    first = table({"settings": settings, "sizes": {}}).splitlines()[0]
    assert "overlap_forward on, step gradients let go once pushed, layer-wise keeps 8.0 GiB of parameters for backward, 1 node(s)" in first
    entry = {"layerwise": {"tokens_per_s": 1608.0, "step_s": 0.637, "peak_gpu_mb": 3379.0, "nodes": [node], "fetched_mb_per_step": 3846.0}}
    layerwise = table({"sizes": {"1b": {"params": 1_008_349_184, "float32": entry}}}).splitlines()[1]
    assert layerwise.endswith("passes 0.45 s (1.79 ms a bucket), tail 0.37 s; fetched 3.8 GiB a step"), layerwise


def test_limits_come_from_an_earlier_report_or_a_reason_why_not(tmp_path):
    """``--limits-from``: a second run on the box takes the first one's limits (its fractions of the
    offload limit without measuring them again); a report without them is refused, saying what to run."""
    limits = {"pinned_h2d_gbs": 55.0, "pinned_d2h_gbs": 55.1, "cpu_adamw_mparams_per_s": 3988.4, "node_update_threads": 13}
    measured = tmp_path / "first.json"
    measured.write_text(json.dumps({"benchmark": "gpu", "gpu": "NVIDIA H200", "cpu_cores": 16, "limits": limits, "sizes": {}}))
    assert load_limits(str(measured)) == {**limits, "from": str(measured), "measured_on": {"gpu": "NVIDIA H200", "cpu_cores": 16}}
    check_same_box(load_limits(str(measured)), "NVIDIA H200", 16)
    with pytest.raises(ValueError, match="measured on NVIDIA H200 with 16 CPUs, this box is NVIDIA H100 80GB HBM3 with 16; measure this box's"):
        check_same_box(load_limits(str(measured)), "NVIDIA H100 80GB HBM3", 16)
    unmeasured = tmp_path / "second.json"
    unmeasured.write_text(json.dumps({"benchmark": "gpu", "limits": {"status": "not measured (--no-limits)"}}))
    with pytest.raises(ValueError, match=r"holds no measured limits .*not measured \(--no-limits\)\); run `netoptim bench gpu` with --limits"):
        load_limits(str(unmeasured))
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the limits of"):
        load_limits(str(tmp_path / "junk.json"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="is not a `netoptim bench gpu --out` report"):
        load_limits(str(tmp_path / "list.json"))
    entry = {"compute": {"step_s": 0.135, "tokens_per_s": 7573.0}, "full": {"step_s": 0.614, "tokens_per_s": 1669.0}}
    gpu_bench.summarize(entry, 1_008_349_184, "float32", load_limits(str(measured)))
    assert entry["full_fraction_of_offload_limit"] == pytest.approx(0.2528 / 0.614, rel=1e-3)
