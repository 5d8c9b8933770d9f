"""CURVE on the data plane: encrypted, and only workers whose keys the node allows can push or pull."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from gpu_worker import RemoteAdamW
from tests.optimizer_node.test_metrics import scrape


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Key pairs made once for the module (each ``netoptim keygen`` is a process start)."""
    tmp_path = tmp_path_factory.mktemp("curve")
    for name in ("node", "good", "bad"):
        result = subprocess.run(
            [sys.executable, "-m", "netoptim", "keygen", "--dir", str(tmp_path / "keys"), "--name", name], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0 and "secret key:" in result.stdout
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "good.key").write_bytes((tmp_path / "keys" / "good.key").read_bytes())
    return tmp_path / "keys", allowed


@pytest.mark.parametrize("lanes", [1, 3], ids=["one-connection", "3-lanes"])
def test_only_allowed_workers_get_in(start_node, keys, lanes):
    key_dir, allowed = keys
    node = start_node(
        extra_args=("--curve-secret-key", str(key_dir / "node.key_secret"), "--curve-allow", str(allowed), "--io-threads", str(lanes), "--metrics-port", "0")
    )
    model = torch.nn.Linear(4, 2)
    opt = RemoteAdamW(
        model.parameters(),
        lr=0.1,
        nodes=[node.address],
        rank=0,
        world_size=1,
        curve_secret_key=str(key_dir / "good.key_secret"),
        curve_server_key=str(key_dir / "node.key"),
        connections_per_node=lanes,  # every lane does its own handshake
    )
    before = model.weight.detach().clone()
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert not torch.equal(before, model.weight) and opt.remote_step == 1

    stranger = torch.nn.Linear(4, 2)
    stranger_before = stranger.weight.detach().clone()

    def stranger_joins(secret_key: str, node_key: str) -> None:
        curve = {"curve_secret_key": str(key_dir / secret_key), "curve_server_key": str(key_dir / node_key), "connections_per_node": lanes}
        RemoteAdamW(stranger.parameters(), nodes=[node.address], rank=0, world_size=1, timeout_s=2, **curve)

    with pytest.raises(TimeoutError, match="curve-allow") as refused:  # a key the node does not allow: no handshake, no data
        stranger_joins("bad.key_secret", "node.key")
    assert "the connection: the connection is made but the CURVE handshake fails" in str(refused.value)  # what the socket saw
    bad_key = (key_dir / "bad.key").read_text().split('public-key = "')[1].split('"')[0]
    assert f"its CURVE public key {bad_key} is not in --curve-allow {allowed}" in node.log_text()  # and the node says so
    assert scrape(node.metrics_url)["netoptim_curve_refused_connections_total"] >= lanes  # and counts it: each lane knocked
    with pytest.raises(TimeoutError, match="CURVE handshake fails"):  # an allowed key, but another node's public key
        stranger_joins("good.key_secret", "bad.key")
    with pytest.raises(TimeoutError, match="give this worker its keys") as plain:  # no CURVE at all
        RemoteAdamW(stranger.parameters(), nodes=[node.address], rank=0, world_size=1, timeout_s=2)
    assert "the node uses CURVE and this worker does not" in str(plain.value)
    assert torch.equal(stranger.weight, stranger_before)  # it never received anything
    status = node.log_text()
    assert "registered job" in status and status.count("registered job") == 1  # the strangers never reached the node

    model(torch.ones(1, 4)).sum().backward()  # the allowed worker is still served
    opt.step()
    assert opt.remote_step == 2
    opt.close()


def test_bad_key_files_are_clear_errors(tmp_path, keys):
    key_dir, _ = keys
    with pytest.raises(ValueError, match="holds no secret key"):
        RemoteAdamW(
            torch.nn.Linear(2, 2).parameters(),
            nodes=["tcp://127.0.0.1:1"],
            rank=0,
            world_size=1,
            curve_secret_key=str(key_dir / "good.key"),
            curve_server_key=str(key_dir / "node.key"),
        )
    with pytest.raises(ValueError, match="go together"):
        RemoteAdamW(torch.nn.Linear(2, 2).parameters(), nodes=["tcp://127.0.0.1:1"], rank=0, world_size=1, curve_secret_key=str(key_dir / "good.key_secret"))
    result = subprocess.run(
        [sys.executable, "-m", "netoptim", "node", "--curve-secret-key", str(key_dir / "node.key_secret"), "--curve-allow", str(tmp_path / "empty")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "must be a directory holding the workers' .key files" in result.stderr
