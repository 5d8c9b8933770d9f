"""``netoptim doctor``: this host, a state directory and real nodes on loopback, each problem a
finding that says what to do, and exit status 1 when one stops a run."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch

from netoptim.doctor.disk import file_system
from netoptim.doctor.findings import Finding, as_text
from netoptim.doctor.node import _dialable
from tests.cli import run_netoptim
from transport.zeromq.security import generate_keypair

TOKEN = "doctor-token"


def doctor(*args: str) -> tuple[int, dict[tuple[str, str], dict]]:
    """``netoptim doctor --json ARGS``: the exit status and the findings by (area, check)."""
    result = run_netoptim("doctor", "--json", *args)
    report = json.loads(result.stdout)
    assert report["ok"] == (result.returncode == 0), result.stderr
    return result.returncode, {(finding["area"], finding["check"]): finding for finding in report["findings"]}


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_this_host_and_a_state_dir(tmp_path):
    state = tmp_path / "state"
    code, found = doctor("--state-dir", str(state), "--probe-bytes", "16MiB", "--params", "100M")
    assert code == 0
    host = {check: finding for (area, check), finding in found.items() if area == "this host"}
    assert {"software", "cpus", "memory", "update path", "update rate", "huge pages", "memory files", "open files", "gpus"} <= set(host)
    assert host["cpus"]["figures"]["cpus"] >= 1 and host["memory"]["figures"]["available_bytes"] > 0
    update = host["update rate"]["figures"]
    assert update["threads"] == host["cpus"]["figures"]["node_update_threads"]
    assert update["update_seconds_per_step"] == pytest.approx(100e6 / (update["mparams_per_s"] * 1e6), rel=0.01)
    area = f"state dir {state}"
    assert found[(area, "directory")]["detail"].startswith(f"does not exist yet (the node creates it in {tmp_path})")
    assert not state.exists() and not list(tmp_path.iterdir())  # the probes left nothing behind
    rate = found[(area, "disk rate")]["figures"]
    assert rate["write_gbs"] > 0 and rate["read_gbs"] > 0
    assert found[(area, "file system")]["figures"]["type"] == file_system(tmp_path)[1]


def test_a_job_too_large_for_the_host_fails_with_what_to_change(tmp_path):
    code, found = doctor("--no-host", "--state-dir", str(tmp_path), "--params", "100T", "--probe-bytes", "0")
    assert code == 1
    space = found[(f"state dir {tmp_path}", "free space")]
    assert space["level"] == "fail" and "more nodes" in space["fix"] and space["figures"]["needed_bytes"] == 12 * 10**14 * (1 + 3), (
        "the state and the 3 checkpoints a node keeps by default"
    )
    code, found = doctor("--params", "100T", "--workers", "2", "--probe-bytes", "0")
    memory = found[("this host", "memory")]
    assert code == 1 and memory["level"] == "fail" and "--memory-budget" in memory["fix"]


def test_a_step_s_disk_time_is_estimated_for_the_job(tmp_path):
    code, found = doctor("--no-host", "--state-dir", str(tmp_path), "--params", "10M", "--memory-budget", "16MiB", "--probe-bytes", "16MiB")
    rate = found[(f"state dir {tmp_path}", "disk rate")]
    assert code == 0 and rate["figures"]["disk_seconds_per_step"] > 0 and "120,000,000" not in rate["detail"]
    assert "0.1 GiB of state" in rate["detail"]


def test_state_dirs_that_cannot_hold_state(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    code, found = doctor("--no-host", "--state-dir", str(a_file))
    assert code == 1 and found[(f"state dir {a_file}", "directory")]["detail"] == "it exists and is not a directory"
    unwritable = Path("/proc/sys/netoptim-state")
    code, found = doctor("--no-host", "--state-dir", str(unwritable))
    directory = found[(f"state dir {unwritable}", "directory")]
    assert code == 1 and "a file cannot be made in /proc/sys" in directory["detail"] and "writ" in directory["fix"]


def test_state_in_memory_is_a_warning(tmp_path_factory):
    if file_system(Path("/dev/shm")) is None or file_system(Path("/dev/shm"))[1] != "tmpfs":
        pytest.fail("this test needs /dev/shm on tmpfs, as Linux hosts have it")
    state = Path("/dev/shm") / f"netoptim-doctor-{time.monotonic_ns()}"
    code, found = doctor("--no-host", "--state-dir", str(state), "--probe-bytes", "0")
    kind = found[(f"state dir {state}", "file system")]
    assert code == 0 and kind["level"] == "warn" and "saves no memory" in kind["detail"] and "disk" in kind["fix"]


def test_mount_table_lookup(tmp_path):
    table = tmp_path / "mountinfo"
    table.write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "30 22 0:26 / /mnt/my\\040disk rw shared:2 - xfs /dev/sdb1 rw\n"
        "31 22 0:27 / /mnt rw - tmpfs tmpfs rw\n"
        "32 31 0:28 / /mnt rw - btrfs /dev/sdc rw\n"  # mounted over the tmpfs: the last one counts
    )
    assert file_system(Path("/mnt/my disk/state"), table) == ("/mnt/my disk", "xfs")
    assert file_system(Path("/mnt/other"), table) == ("/mnt", "btrfs")
    assert file_system(Path("/var/lib"), table) == ("/", "ext4")
    assert file_system(Path("/x"), tmp_path / "missing") is None


def test_a_running_node_is_reached_and_measured(start_node):
    node = start_node(extra_args=("--admin", "127.0.0.1:0"))
    code, found = doctor("--no-host", "--admin", node.admin_address, "--probe-bytes", "8MiB", "--params", "10M", "--wire-dtype", "bfloat16")
    assert code == 0, found
    admin = f"admin {node.admin_address}"
    assert found[(admin, "health")]["detail"] == "SERVING" and found[(admin, "version")]["level"] == "ok"
    assert "no job registered" in found[(admin, "status")]["detail"]
    data = f"node {node.address}"  # probed through the address the node's status gave
    assert found[(data, "reachable")]["level"] == "ok" and "on this host" in found[(data, "reachable")]["detail"]
    rate = found[(data, "rate")]["figures"]
    assert found[(data, "round trip")]["figures"]["rtt_ms"] > 0 and rate["gbs_each_way"] > 0
    assert rate["exchange_seconds_per_step"] == pytest.approx(2 * 10e6 / (rate["gbs_each_way"] * 1e9), rel=0.02, abs=0.001)


def test_nothing_listening_is_said_before_the_timeout_ends(tmp_path):
    address = f"tcp://127.0.0.1:{closed_port()}"
    started = time.monotonic()
    code, found = doctor("--no-host", "--node", address, "--timeout", "2")
    reachable = found[(f"node {address}", "reachable")]
    assert code == 1 and time.monotonic() - started < 10
    assert "nothing accepts connections at that address" in reachable["detail"] and "start the node" in reachable["fix"]


@pytest.mark.parametrize(
    ("address", "said"),
    [("http://127.0.0.1:80", "is not a node's data address"), ("tcp://127.0.0.1", "has no host or port")],
)
def test_malformed_addresses(address, said):
    code, found = doctor("--no-host", "--node", address)
    assert code == 1 and said in found[(f"node {address}", "address")]["detail"]


def test_curve_keys_that_match_and_keys_that_do_not(start_node, tmp_path):
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    for name in ("node", "good", "stranger"):
        generate_keypair(str(keys), name)
    allowed.mkdir()
    (allowed / "good.key").write_bytes((keys / "good.key").read_bytes())
    node = start_node(extra_args=("--curve-secret-key", str(keys / "node.key_secret"), "--curve-allow", str(allowed)))
    area = f"node {node.address}"

    def probe(*curve: str) -> tuple[int, dict]:
        code, found = doctor("--no-host", "--node", node.address, "--timeout", "2", "--probe-bytes", "4MiB", *curve)
        return code, found[(area, "reachable")]

    code, reachable = probe("--curve-secret-key", str(keys / "good.key_secret"), "--curve-server-key", str(keys / "node.key"))
    assert code == 0 and "CURVE" in reachable["detail"]
    code, reachable = probe("--curve-secret-key", str(keys / "stranger.key_secret"), "--curve-server-key", str(keys / "node.key"))
    assert code == 1 and "CURVE handshake fails" in reachable["detail"] and "--curve-allow" in reachable["fix"]
    code, reachable = probe()
    assert code == 1 and "the node uses CURVE and this worker does not" in reachable["detail"] and "--curve-secret-key" in reachable["fix"]


def test_admin_problems_say_what_to_do(start_node, tmp_path):
    node = start_node(extra_args=("--admin", "127.0.0.1:0", "--admin-token", TOKEN))
    code, found = doctor("--no-host", "--admin", node.admin_address)
    status = found[(f"admin {node.admin_address}", "status")]
    assert code == 1 and status["detail"].startswith("UNAUTHENTICATED") and "--token-file" in status["fix"]
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    code, found = doctor("--no-host", "--admin", node.admin_address, "--token-file", str(token_file), "--probe-bytes", "0")
    assert code == 0 and found[(f"admin {node.admin_address}", "status")]["level"] == "ok"
    nowhere = f"127.0.0.1:{closed_port()}"
    code, found = doctor("--no-host", "--admin", nowhere, "--timeout", "2")
    status = found[(f"admin {nowhere}", "status")]
    assert code == 1 and status["detail"].startswith("UNAVAILABLE") and "--admin HOST:PORT" in status["fix"]


def test_a_wildcard_data_address_is_dialed_at_the_admin_host():
    assert _dialable("tcp://0.0.0.0:5555", "10.1.2.3:7000") == "tcp://10.1.2.3:5555"
    assert _dialable("tcp://[::]:5555", "[fd00::1]:7000") == "tcp://[fd00::1]:5555"
    assert _dialable("tcp://10.9.9.9:5555", "10.1.2.3:7000") == "tcp://10.9.9.9:5555"
    assert _dialable("", "10.1.2.3:7000") is None


def test_findings_that_need_a_fix_have_one():
    with pytest.raises(ValueError, match="says what to do"):
        Finding("this host", "cpus", "warn", "one CPU")
    with pytest.raises(ValueError, match="level must be one of"):
        Finding("this host", "cpus", "bad", "x")  # type: ignore[arg-type]
    text = as_text([Finding("this host", "cpus", "ok", "2 CPUs"), Finding("node x", "reachable", "fail", "no answer", "start it")])
    assert "FAIL  reachable  no answer" in text and "fix: start it" in text and "1 problem(s) stop a run" in text


def test_help_explains_every_flag():
    result = run_netoptim("doctor", "--help")
    assert result.returncode == 0
    for flag in (
        "--node",
        "--admin",
        "--token-file",
        "--curve-secret-key",
        "--state-dir",
        "--params",
        "--memory-budget",
        "--probe-bytes",
        "--timeout",
        "--json",
    ):
        assert flag in result.stdout


def test_a_gpu_s_copy_rates_bound_a_step(tmp_path):
    """The arithmetic of the GPU check (its copies run where CUDA exists): the slower way sets the floor."""
    from gpu_worker.layerwise.copy_rates import copy_bandwidth_gbs
    from netoptim.cli.job_size_args import job_size
    from netoptim.console import build_parser
    from netoptim.doctor.host import copy_rates_said

    plan = job_size(build_parser().parse_args(["doctor", "--params", "1B", "--wire-dtype", "bfloat16"]))
    said, figures = copy_rates_said({"pinned_h2d_gbs": 50.0, "pinned_d2h_gbs": 40.0, "pageable_h2d_gbs": 7.0}, plan)
    assert figures["copy_seconds_per_step"] == pytest.approx(2e9 / 40e9) and "at least 0.05 s" in said
    rates = copy_bandwidth_gbs(torch.device("cpu"), nbytes=1 << 20, repeats=1)  # the same probe, run on the CPU here
    assert set(rates) == {"pinned_h2d_gbs", "pinned_d2h_gbs", "pageable_h2d_gbs"} and min(rates.values()) > 0
    assert copy_rates_said(rates, None)[1].get("copy_seconds_per_step") is None


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--workers", "4"), "--workers size(s) a job: give --params (or --hf-config) too"),
        (("--memory-budget", "4GiB", "--layerwise"), "--memory-budget, --layerwise size(s) a job"),
        (("--token-file", "t", "--state-dir", "."), "--token-file and --tls-ca apply to --admin"),
        (("--curve-secret-key", "a", "--curve-server-key", "b"), "the CURVE keys apply to the nodes probed"),
        (("--timeout", "nan", "--node", "tcp://127.0.0.1:1"), "--timeout must be a positive number"),
        (("--no-host",), "--no-host leaves nothing to check"),
    ],
)
def test_flags_that_would_change_nothing_are_refused(args, said):
    result = run_netoptim("doctor", *args)
    assert result.returncode == 2 and said in result.stderr, result.stderr
