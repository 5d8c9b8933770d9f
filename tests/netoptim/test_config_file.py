"""``--config FILE``: TOML for the node ([node]) and the recipes ([worker]); flags override it, errors
name the key and its line, ``--print-config`` says where each value came from."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from netoptim.console import parse_command_line
from netoptim.recipes.train_gpt import build_parser as recipe_parser
from netoptim.recipes.train_gpt import parse_recipe_args
from tests.netoptim.in_process import in_process


def netoptim(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "netoptim", *args], capture_output=True, text=True, timeout=60)


def test_flags_override_the_file_and_sources_are_told(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text('# job\n[node]\nkeep = 7\ncheckpoint_every = 5\ncheckpoint-dir = "ckpt"\nmax-message-bytes = "1GiB"\nno-same-host-ipc = true\n')
    args = parse_command_line(["node", "--config", str(config), "--keep", "2"])
    assert args.keep == 2 and args.checkpoint_every == 5 and args.checkpoint_dir == "ckpt"
    assert args.max_message_bytes == 1 << 30 and args.same_host_ipc is False
    assert args.config_sources.of("keep") == "command line"
    assert args.config_sources.of("checkpoint_every") == f"{config}:4"
    assert args.config_sources.of("listen") == "default"
    shown = netoptim("node", "--config", str(config), "--keep", "2", "--admin-token", "hidden-value", "--print-config")
    assert shown.returncode == 0, shown.stderr
    assert f"# {config}:5" in shown.stdout and "# command line" in shown.stdout and "hidden-value" not in shown.stdout


@pytest.mark.parametrize(
    "body, message",
    [
        ("[node]\nkeep = 3\nchekpoint-every = 5\n", ":3: unknown key 'chekpoint-every'"),
        ("[node]\n\nkeep = 'many'\n", ":3: keep = 'many'"),
        ("[node]\nresume = 1\n", ":2: resume must be true or false"),
        ("[worker]\nsteps = 1\n", "has no [node] table"),
        ("[node\n", "not valid TOML"),
    ],
)
def test_a_wrong_file_names_the_key_and_line(tmp_path, body, message, capsys, caplog):
    config = tmp_path / "bad.toml"
    config.write_text(body)
    code, stderr = in_process(["node", "--config", str(config)], capsys, caplog)
    assert code == 2 and message in stderr, stderr


def test_a_node_runs_from_its_file(tmp_path):
    ready = tmp_path / "ready.json"
    config = tmp_path / "node.toml"
    config.write_text(f'[node]\nlisten = "tcp://127.0.0.1:0"\nready-file = "{ready}"\nthreads = 1\nnode-id = "from-file"\n')
    node = subprocess.Popen([sys.executable, "-m", "netoptim", "node", "--config", str(config)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and node.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert json.loads(ready.read_text())["node_id"] == "from-file"
    finally:
        node.send_signal(signal.SIGTERM)
        node.communicate(timeout=30)
    assert node.returncode == 0


def test_recipes_read_the_worker_table(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text('[node]\nsteps = 2\n\n[worker]\nnodes = "tcp://127.0.0.1:5555"\nsteps = 12\nlayerwise = true\n')
    args = parse_recipe_args(recipe_parser(), ["--config", str(config), "--steps", "3"])
    assert args.nodes == "tcp://127.0.0.1:5555" and args.steps == 3 and args.layerwise is True


def test_version():
    result = netoptim("--version")
    assert result.returncode == 0 and result.stdout.startswith("netoptim ")
