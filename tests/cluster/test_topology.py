"""The emulated cluster's plumbing: hosts as namespaces, shaped links, counters, and nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from netoptim.cluster import cleanup, counters, netns, shaping, topology
from netoptim.cluster.scaling import scale_links

requires_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the emulated cluster creates network namespaces, veths and a bridge: root only (the CI runs as root)"
)

RATE_BIT_S = 16e6
TRANSFER_BYTES = 1 << 20  # 0.5 s at the rate: long against tbf's 32 KiB burst, short for a test

RECEIVER = """
import socket, sys, time
server = socket.socket()
server.bind((sys.argv[1], 7001))
server.listen(1)
print("listening", flush=True)
conn, _ = server.accept()
total, first = 0, None
while True:
    data = conn.recv(1 << 16)
    if not data:
        break
    first = first or time.perf_counter()
    total += len(data)
print(total, time.perf_counter() - first, flush=True)
"""
SENDER = "import socket, sys; s = socket.create_connection((sys.argv[1], 7001)); s.sendall(b'x' * int(sys.argv[2])); s.close()"


def _transfer(source: topology.Host, target: topology.Host) -> float:
    """Bits per second of a bounded TCP transfer from ``source`` to ``target``, as the receiver timed it."""
    receiver = subprocess.Popen(netns.in_namespace(target.namespace, [sys.executable, "-c", RECEIVER, target.address]), stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None and receiver.stdout.readline().strip() == "listening"
        subprocess.run(netns.in_namespace(source.namespace, [sys.executable, "-c", SENDER, target.address, str(TRANSFER_BYTES)]), check=True, timeout=30)
        total, seconds = receiver.communicate(timeout=30)[0].split()
    finally:
        receiver.kill()
    assert int(total) == TRANSFER_BYTES
    return TRANSFER_BYTES * 8 / float(seconds)


def _nothing_left(prefix: str) -> None:
    assert not cleanup.leftover_namespaces(prefix), f"namespaces of {prefix} remain"
    assert not cleanup.leftover_links(prefix), f"interfaces of {prefix} remain"
    assert not (cleanup.OWNERS_DIR / f"{prefix}.json").exists()


@requires_root
def test_links_are_shaped_both_ways_counted_and_removed():
    topo = topology.plan_topology(1, 1, cleanup.new_prefix())
    worker, node = topo.hosts
    try:
        topology.build(topo)
        shaping.shape_all(topo, RATE_BIT_S)
        assert shaping.link_rates(topo, worker) == (RATE_BIT_S, RATE_BIT_S)
        before = counters.read_counters(topo)
        upload = _transfer(worker, node)
        download = _transfer(node, worker)
        carried = counters.difference(counters.read_counters(topo), before)
        shaping.shape_all(topo, RATE_BIT_S, node_rate_bit_s=2 * RATE_BIT_S)  # a node host with a faster port
        assert shaping.link_rates(topo, node) == (2 * RATE_BIT_S, 2 * RATE_BIT_S)
        assert shaping.link_rates(topo, worker) == (RATE_BIT_S, RATE_BIT_S)
    finally:
        topology.teardown(topo)
    print(f"\nshaped at {RATE_BIT_S / 1e6:.0f} Mbit/s: {upload / 1e6:.2f} up, {download / 1e6:.2f} down; counted {carried}")
    # Goodput below the rate by the TCP/IP headers (~5%) and the connection's start; never above it
    # by more than the first burst lets through.
    for rate in (upload, download):
        assert 0.6 * RATE_BIT_S < rate < 1.15 * RATE_BIT_S
    for host in ("w0", "n0"):  # every payload byte crossed both links, plus headers
        assert TRANSFER_BYTES <= carried[host].up < 1.2 * TRANSFER_BYTES
        assert TRANSFER_BYTES <= carried[host].down < 1.2 * TRANSFER_BYTES
    _nothing_left(topo.prefix)


def _owned_by(pid: int, timeout_s: float = 60) -> str:
    """The prefix of the run that process ``pid`` records once it has built its cluster."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for record in cleanup.OWNERS_DIR.glob(f"{cleanup.BASE}*.json") if cleanup.OWNERS_DIR.is_dir() else []:
            try:
                if json.loads(record.read_text())["pid"] == pid:
                    return record.stem
            except (OSError, ValueError):
                continue
        time.sleep(0.05)
    raise AssertionError(f"process {pid} recorded no cluster within {timeout_s} s")


def _start_runner() -> tuple[subprocess.Popen, str, list[int]]:
    """A ``netoptim cluster`` run long enough to be interrupted, once its node runs: (process, prefix, the node's pids)."""
    runner = subprocess.Popen(
        [sys.executable, "-m", "netoptim", "cluster", "--worker-hosts", "1", "--node-hosts", "1", "--emulated-mbit", "50", "--steps", "1000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        prefix = _owned_by(runner.pid)
        node_namespace = cleanup.Names(prefix).host("n0")
        deadline = time.monotonic() + 60
        while not netns.namespace_pids(node_namespace):  # the node has started: the run is in full swing
            assert runner.poll() is None and time.monotonic() < deadline, "the runner ended or never started its node"
            time.sleep(0.05)
        return runner, prefix, netns.namespace_pids(node_namespace)
    except BaseException:
        runner.kill()
        raise


def _gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_running(pid) for pid in pids)


@requires_root
def test_cleanup_removes_what_a_runner_killed_with_sigkill_left():
    runner, prefix, started = _start_runner()
    try:
        runner.send_signal(signal.SIGKILL)
        runner.wait(10)
        assert cleanup.leftover_namespaces(prefix), "a runner killed with SIGKILL cannot have removed its namespaces"
        assert not cleanup.owner_alive(prefix)
    finally:
        if runner.poll() is None:
            runner.kill()
    result = subprocess.run([sys.executable, "-m", "netoptim", "cluster", "--cleanup"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"removed namespace {cleanup.Names(prefix).host('n0')}" in result.stdout
    _nothing_left(prefix)
    assert _gone(started), "the node the runner started still runs"


@requires_root
def test_a_runner_stopped_with_sigterm_removes_everything_itself():
    runner, prefix, started = _start_runner()
    try:
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(60) == 128 + signal.SIGTERM
    finally:
        if runner.poll() is None:
            runner.kill()
    _nothing_left(prefix)
    assert _gone(started), "the node the runner started still runs"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="not a cluster run prefix"):
        cleanup.check_prefix("eth0")
    with pytest.raises(ValueError, match="private"):
        topology.plan_topology(1, 1, cleanup.new_prefix(), subnet="8.8.8.0/24")
    with pytest.raises(ValueError, match="room for"):
        topology.plan_topology(3, 1, cleanup.new_prefix(), subnet="10.231.0.0/30")
    with pytest.raises(ValueError, match="at least one worker host"):
        topology.plan_topology(0, 1, cleanup.new_prefix())
    with pytest.raises(ValueError, match="at least"):
        shaping.tbf_args(10.0)
    with pytest.raises(ValueError, match="positive"):
        scale_links(25, 0, 1e9, 0.1)


def test_names_fit_linux_interface_names():
    topo = topology.plan_topology(topology.MAX_HOSTS - 1, 1, cleanup.new_prefix())
    assert all(len(host.link) <= 15 for host in topo.hosts) and len(topo.names.bridge) <= 15
    assert len({host.address for host in topo.hosts}) == topology.MAX_HOSTS


def test_link_scale_keeps_the_targets_compute_to_communication_ratio():
    scaling = scale_links(25.0, 100.0, flops=2e9, cpu_step_s=0.1)  # 20 GFLOP/s here: 5000 times slower than the target
    assert scaling.target_step_s == pytest.approx(2e-5)
    assert scaling.emulated_bit_s == pytest.approx(25e9 / 5000)


def test_without_root_the_command_says_so(monkeypatch, capsys):
    from netoptim.console import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["cluster", "--cleanup"]) == 1
    assert "needs root" in capsys.readouterr().err
