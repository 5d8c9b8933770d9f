"""``netoptim doctor`` from one emulated host to a node on another: the node found on another host, its
rate the link's shaped rate, and an address where no host answers said so."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys

import pytest

from netoptim.cluster import cleanup, netns, shaping, topology
from netoptim.launch.processes import NodeProcess

LINK_BIT_S = 200e6

requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces, veths and a bridge: root only (the CI runs as root)")


@requires_root
def test_doctor_measures_the_link_to_a_node_on_another_host(tmp_path):
    topo = topology.plan_topology(1, 1, cleanup.new_prefix())
    topology.build(topo)
    try:
        shaping.shape_all(topo, LINK_BIT_S)
        worker_host, node_host = topo.worker_hosts[0], topo.node_hosts[0]
        nobody = str(ipaddress.IPv4Network(topo.subnet).network_address + 50)  # in the subnet, no host has it
        # --insecure: a node on an address other than loopback needs CURVE or this flag
        node = NodeProcess(tmp_path, listen=f"tcp://{node_host.address}:0", extra_args=("--insecure",), log_level="WARNING")
        node.command = netns.in_namespace(node_host.namespace, node.command)
        node.start(timeout_s=120)
        try:
            doctor = [sys.executable, "-m", "netoptim", "doctor", "--json", "--no-host", "--timeout", "2", "--probe-bytes", "8MiB"]
            command = [*doctor, "--node", node.address, "--node", f"tcp://{nobody}:5555"]
            result = subprocess.run(netns.in_namespace(worker_host.namespace, command), capture_output=True, text=True, timeout=120)
        finally:
            node.stop()
    finally:
        topology.teardown(topo)
    assert not cleanup.leftover_namespaces(topo.prefix)
    assert result.returncode == 1, result.stderr  # the address nobody has
    found = {(finding["area"], finding["check"]): finding for finding in json.loads(result.stdout)["findings"]}
    reachable = found[(f"node {node.address}", "reachable")]
    assert reachable["level"] == "ok" and "on another host" in reachable["detail"]
    rate = found[(f"node {node.address}", "rate")]["figures"]["gbs_each_way"]
    link = LINK_BIT_S / 8 / 1e9
    assert 0.5 * link < rate < 1.05 * link, f"{rate} GB/s each way on a link shaped to {link} GB/s each way"
    silent = found[(f"node tcp://{nobody}:5555", "reachable")]
    assert silent["level"] == "fail" and "the host has not answered" in silent["detail"] and "firewall" in silent["fix"]
