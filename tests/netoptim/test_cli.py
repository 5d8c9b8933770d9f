"""The netoptim command as a user runs it: real processes, real flags."""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys

import pytest

from netoptim.console import build_parser
from tests.netoptim.in_process import in_process


def netoptim(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "netoptim", *args], capture_output=True, text=True, timeout=timeout)


def all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from all_parsers(child)


def test_help_explains_every_flag():
    parsers = list(all_parsers(build_parser()))
    assert {p.prog for p in parsers} >= {
        "netoptim",
        "netoptim node",
        "netoptim demo",
        "netoptim plan-memory",
        "netoptim bench optimizer",
        "netoptim bench transport",
        "netoptim bench train",
        "netoptim bench offload",
        "netoptim bench plan",
        "netoptim plan",
    }
    for parser in parsers:
        for action in parser._actions:
            if action.option_strings:
                assert action.help, f"{parser.prog} {action.option_strings[0]} has no help text"
        parser.format_help()  # every %(default)s expands


def test_pipeline_recipe_explains_every_flag():
    from netoptim.recipes.train_gpt_pipeline import build_parser as pipeline_parser

    parser = pipeline_parser()
    assert all(action.help for action in parser._actions if action.option_strings)
    assert "--stages" in parser.format_help()


def test_help_runs_from_the_console():
    result = netoptim("node", "--help")
    assert result.returncode == 0 and "--listen" in result.stdout and "port 0 lets the OS choose" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["node", "--listen", "localhost:5555"], "needs a scheme"),
        (["node", "--listen", "udp://127.0.0.1:1"], "unsupported scheme"),
        (["node", "--max-message-bytes", "12XB"], "not a size"),
        (["node", "--chunk-bytes", "-4"], "must be positive"),
        (["node", "--io-threads", "0"], "must be positive"),
        (["node", "--io-threads", "65"], "io_threads must be in [1, 64]"),
        (["node", "--cpus", "4096"], "CPU 4096 is not among those this process may use"),
        (["node", "--cpus", "0-"], "not a CPU list"),
        (["node", "--numa-node", "4095"], "NUMA node 4095 has no CPU this process may use"),
        (["node", "--cpus", "0", "--numa-node", "0"], "not both"),
        (["demo", "--steps", "0"], "must be positive"),
        (["demo", "--workers", "two"], "not an integer"),
        (["bench", "optimizer", "--repeats", "0"], "must be positive"),
        (["bench", "train", "--sizes", "huge"], "sizes are a comma-separated list"),
        (["bench", "gpu", "--limits-from", "/nonexistent/gpu.json"], "cannot read the limits of /nonexistent/gpu.json"),
        (["plan-memory", "--params", "lots", "--workers", "2"], "not a parameter count"),
        (["node", "--memory-budget", "0"], "must be positive"),
        (["node", "--state-dir", "/tmp/x"], "state_dir and memory_budget go together"),
        (["node", "--pass-thread", "--state-dir", "/tmp/x", "--memory-budget", "1GiB"], "drop --pass-thread or --state-dir"),
        (["node", "--state-io-threads", "0"], "state_io_threads must be in [1, 64]"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_flags_exit_2_with_a_reason(args, message, capsys, caplog):
    """In this process (a command refused before it starts anything; the console's own exit is
    checked below): a fresh interpreter per case cost 2 s of imports each."""
    code, stderr = in_process(args, capsys, caplog)
    assert code == 2 and message in stderr, stderr


def test_a_bad_flag_exits_2_from_the_console():
    result = netoptim("node", "--listen", "localhost:5555")
    assert result.returncode == 2 and "needs a scheme" in result.stderr, result.stderr


def test_node_refuses_an_address_in_use(start_node):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = netoptim("node", "--listen", f"tcp://127.0.0.1:{port}")
    assert result.returncode == 1 and "cannot start the node" in result.stderr


def test_node_writes_ready_file_and_stops_on_sigterm(node):
    ready = json.loads(node.ready_file.read_text())
    assert ready["data"] == node.address and ready["data"].startswith("tcp://127.0.0.1:")
    assert node.stop() == 0
    log = node.log_text()
    assert "node config:" in log and "stopped at step 0" in log


@pytest.mark.parametrize("mode", [(), pytest.param(("--layerwise",), marks=pytest.mark.slow)], ids=["full-model", "layer-wise"])
def test_demo_trains_and_the_loss_falls(mode):
    result = netoptim("demo", "--steps", "20", *mode, timeout=300)  # the loss falls by ~1.4 in 20 steps
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"loss: ([\d.]+) at the start -> ([\d.]+) at the end", result.stdout)
    assert match, result.stdout
    start, end = map(float, match.groups())
    assert end < start - 0.5
    assert "sample:" in result.stdout


def test_plan_memory_prints_what_a_node_needs():
    result = netoptim("plan-memory", "--params", "3B", "--workers", "2", "--layerwise", "--memory-budget", "6GiB", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["per_node"]
    assert plan["params"] == 3_000_000_000
    assert plan["ram_in_memory"] > 12 * 3e9 and plan["disk_out_of_core"] == 12 * 3_000_000_000 * (1 + 3), "the state and the node's 3 checkpoints by default"
    no_checkpoints = netoptim("plan-memory", "--params", "3B", "--workers", "2", "--layerwise", "--memory-budget", "6GiB", "--keep", "0", "--json")
    assert json.loads(no_checkpoints.stdout)["per_node"]["disk_out_of_core"] == 12 * 3_000_000_000
    assert 6 << 30 < plan["ram_out_of_core"] < (6 << 30) + (3 << 30), "budget + overhead + two push windows"
    assert plan["same_host_board"] == 0, "two fp32 versions of the share: the masters themselves, and one in place of the kept copy"
    bf16 = netoptim("plan-memory", "--params", "3B", "--workers", "2", "--wire-dtype", "bfloat16", "--json")
    assert json.loads(bf16.stdout)["per_node"]["same_host_board"] == 0, "two bf16 versions, in place of the kept copy and the cast"
    table = netoptim("plan-memory", "--params", "85M", "--workers", "2", "--nodes", "2")
    assert table.returncode == 0 and "GiB RAM per node" in table.stdout and "parameter board" in table.stdout


@pytest.mark.slow  # calibrates on this machine: ~40 s
def test_plan_calibrates_here_and_ranks_configurations(tmp_path):
    calibration = tmp_path / "calibration.json"
    args = ("plan", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--global-batch", "4", "--max-microbatches", "2")
    result = netoptim(*args, "--calibration", str(calibration), "--json", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranked = json.loads(result.stdout)
    assert ranked and [r["predicted_step_s"] for r in ranked] == sorted(r["predicted_step_s"] for r in ranked)
    assert {(r["stages"], r["replicas"]) for r in ranked} == {(1, 2), (2, 1)}
    saved = json.loads(calibration.read_text())
    assert saved["action_overhead_s"] >= 0 and saved["optimizer"]["1"]["per_param_s"] > 0 and set(saved["block_costs"]) == {"1", "2", "4"}
    again = netoptim(*args, "--calibration", str(calibration), "--memory-limit", "1", timeout=60)  # the saved calibration, nothing fits
    assert again.returncode != 0 and "no configuration fits" in again.stderr
    other = netoptim(*args[:2], "3", *args[3:], "--calibration", str(calibration), timeout=60)  # another model, the same file
    assert other.returncode != 0 and "was measured for the model" in other.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--n-embd", "30", "--n-head", "4"), "multiple of --n-head"),
        (("--workers", "0"), "--workers must be >= 1"),
        (("--cores", "-1"), "--cores must be >= 0"),
    ],
)
def test_plan_refuses_bad_flags(flags, message, capsys, caplog):
    code, stderr = in_process(["plan", *flags], capsys, caplog)
    assert code != 0 and message in stderr, stderr


def test_the_command_line_is_built_without_importing_torch():
    """``netoptim --help`` and every subcommand's flags answer at once: torch (seconds to import) is
    imported by the commands that run, not by the parser."""
    probe = "import sys; from netoptim.console import build_parser; build_parser(); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
