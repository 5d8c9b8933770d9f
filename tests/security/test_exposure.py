"""Secure by default: a node reachable from other hosts without authentication refuses to start unless
told ``--insecure`` (and then warns at every start); secrets stay off the command line and out of
files others can read."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from optimizer_node.config import NodeConfig
from transport.exposure import reachable_from_network
from transport.secret_files import check_private, read_token_file
from transport.zeromq.security import generate_keypair, load_keypair


def netoptim(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "netoptim", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "url, exposed",
    [
        ("tcp://127.0.0.1:5555", False),
        ("tcp://127.0.0.2:0", False),
        ("tcp://localhost:0", False),
        ("tcp://[::1]:0", False),
        ("ipc:///tmp/x.sock", False),
        ("tcp://lo:0", False),
        ("tcp://0.0.0.0:5555", True),
        ("tcp://*:5555", True),
        ("tcp://[::]:5555", True),
        ("tcp://10.1.2.3:5555", True),
        ("mooncake://0.0.0.0:5555", True),
        ("mooncake://127.0.0.1:0", False),
    ],
)
def test_which_addresses_other_hosts_reach(url, exposed):
    assert reachable_from_network(url) is exposed


def test_an_exposed_data_plane_needs_curve_or_insecure(tmp_path):
    with pytest.raises(ValueError, match=r"netoptim keygen.*--insecure"):
        NodeConfig(listen="tcp://0.0.0.0:5555").validate()
    with pytest.raises(ValueError, match="Mooncake transport has no encryption"):
        NodeConfig(listen="mooncake://0.0.0.0:5555").validate()
    NodeConfig(listen="tcp://0.0.0.0:5555", insecure=True).validate()
    _public, secret = generate_keypair(str(tmp_path / "keys"), "node")
    NodeConfig(listen="tcp://0.0.0.0:5555", curve_secret_key=str(secret), curve_allow=str(tmp_path / "keys")).validate()
    NodeConfig(listen="tcp://127.0.0.1:0").validate()


def test_the_cli_refuses_an_exposed_node_saying_how_to_secure_it(tmp_path):
    ready = tmp_path / "ready.json"
    result = netoptim("node", "--listen", "tcp://0.0.0.0:0", "--ready-file", str(ready))
    assert result.returncode == 2
    assert "netoptim keygen" in result.stderr and "--curve-secret-key" in result.stderr and "--insecure" in result.stderr
    assert not ready.exists()
    result = netoptim("node", "--admin", "0.0.0.0:0", "--ready-file", str(ready))
    assert result.returncode == 2 and "--admin-token-file" in result.stderr and not ready.exists()


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root and unshare for a private network namespace")
def test_an_insecure_node_warns_at_start(tmp_path):
    # In a network namespace of its own, 0.0.0.0 reaches no other host: the node binds it safely.
    ready = tmp_path / "ready.json"
    node = subprocess.Popen(
        [
            "unshare",
            "--net",
            sys.executable,
            "-m",
            "netoptim",
            "node",
            "--listen",
            "tcp://0.0.0.0:0",
            "--insecure",
            "--threads",
            "1",
            "--ready-file",
            str(ready),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and node.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), "the node did not start"
    finally:
        node.send_signal(signal.SIGTERM)
        _, stderr = node.communicate(timeout=30)
    assert node.returncode == 0
    assert "INSECURE" in stderr and "--curve-secret-key" in stderr


def test_secret_files_others_can_read_are_refused(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_token_file(str(token))
    token.chmod(0o600)
    assert read_token_file(str(token)) == "s3cret"
    token.write_text("")
    with pytest.raises(ValueError, match="one line"):
        read_token_file(str(token))
    with pytest.raises(ValueError, match="cannot read"):
        read_token_file(str(tmp_path / "missing"))
    public, secret = generate_keypair(str(tmp_path / "keys"), "worker")
    load_keypair(str(secret), need_secret=True)
    load_keypair(str(public), need_secret=False)  # a public key is no secret
    Path(secret).chmod(0o640)
    with pytest.raises(ValueError, match="accessible to other users"):
        load_keypair(str(secret), need_secret=True)
    with pytest.raises(FileNotFoundError):
        check_private(str(tmp_path / "nothing"), "x")


def test_the_admin_token_comes_from_a_file_and_argv_warns(tmp_path):
    import grpc

    from protos import admin_pb2, admin_pb2_grpc

    token = tmp_path / "token"
    token.write_text("tok-123\n")
    token.chmod(0o600)
    loose = tmp_path / "loose"
    loose.write_text("tok-123\n")
    loose.chmod(0o644)
    from netoptim.cli.node_configs import admin_config_from_args
    from netoptim.console import parse_command_line

    with pytest.raises(ValueError, match="chmod 600"):
        admin_config_from_args(parse_command_line(["node", "--admin", "127.0.0.1:0", "--admin-token-file", str(loose)]))
    with pytest.raises(ValueError, match="once"):
        admin_config_from_args(parse_command_line(["node", "--admin", "127.0.0.1:0", "--admin-token-file", str(token), "--admin-token", "x"]))

    ready = tmp_path / "ready.json"
    node = subprocess.Popen(
        [sys.executable, "-m", "netoptim", "node", "--threads", "1", "--admin", "127.0.0.1:0", "--admin-token-file", str(token), "--ready-file", str(ready)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        admin = json.loads(ready.read_text())["admin"]
        stub = admin_pb2_grpc.OptimizerNodeAdminStub(grpc.insecure_channel(admin))
        with pytest.raises(grpc.RpcError) as denied:
            stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub.GetStatus(admin_pb2.GetStatusRequest(), metadata=[("authorization", "Bearer tok-123")], timeout=10)
        called = netoptim("admin", "--target", admin, "--token-file", str(token), "status")
        assert called.returncode == 0, called.stderr
    finally:
        node.send_signal(signal.SIGTERM)
        _, stderr = node.communicate(timeout=30)
    assert "visible to every user" not in stderr


def test_a_token_on_the_command_line_works_with_a_warning(caplog):
    from netoptim.cli.node_configs import admin_token
    from netoptim.console import parse_command_line

    args = parse_command_line(["node", "--admin", "127.0.0.1:0", "--admin-token", "tok-123"])
    with caplog.at_level("WARNING", logger="netoptim"):
        assert admin_token(args) == "tok-123"
    assert "visible to every user of this host" in caplog.text
