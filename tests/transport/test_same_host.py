"""The same-host fast path: a node on a tcp:// address also listens on an ipc:// socket, and a worker
on the same host moves to it after its HELLO."""

from __future__ import annotations

import json
import os
import socket

import torch

from gpu_worker import RemoteAdamW
from gpu_worker.node_connections import reachable_here as _reachable_here
from tests.gpu_worker.harness import RunConfig, max_difference, reference_averaged, run_offloaded


def test_a_worker_on_the_nodes_host_moves_to_its_ipc_socket(start_node, tmp_path):
    node = start_node()
    same_host = json.loads(node.ready_file.read_text())["same_host"]
    assert same_host.startswith("ipc://") and _reachable_here(same_host)
    model = torch.nn.Linear(4, 2)
    opt = RemoteAdamW(model.parameters(), lr=0.1, nodes=[node.address], rank=0, world_size=1)
    assert opt._session.connection_addresses == [same_host]
    model(torch.ones(1, 4)).sum().backward()
    opt.step()  # the node answers over the connection the worker moved to
    assert opt.remote_step == 1
    opt.close()
    tcp_only = RemoteAdamW(torch.nn.Linear(4, 2).parameters(), lr=0.1, nodes=[node.address], rank=0, world_size=1, same_host_ipc=False)
    assert tcp_only._session.connection_addresses == [node.address] and tcp_only.remote_step == 1
    tcp_only.close()
    assert node.stop() == 0
    assert not os.path.exists(same_host[len("ipc://") :]), "the socket file goes with the node"


def test_the_fast_path_can_be_switched_off_on_the_node(start_node):
    node = start_node(extra_args=("--no-same-host-ipc",))
    assert "same_host" not in json.loads(node.ready_file.read_text())
    opt = RemoteAdamW(torch.nn.Linear(4, 2).parameters(), nodes=[node.address], rank=0, world_size=1)
    assert opt._session.connection_addresses == [node.address]
    opt.close()


def test_only_a_local_socket_counts_as_same_host(tmp_path):
    assert not _reachable_here("ipc:///nonexistent/netoptim-0.sock")
    assert not _reachable_here("tcp://127.0.0.1:5555")
    regular = tmp_path / "not-a-socket"
    regular.write_text("")
    assert not _reachable_here(f"ipc://{regular}")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(tmp_path / "s.sock"))
        assert _reachable_here(f"ipc://{tmp_path / 's.sock'}")


def test_training_is_bitwise_the_same_over_either_path(start_node):
    """The oracle over the fast path and over TCP: both bitwise equal to fused AdamW."""
    results = []
    for same_host_ipc in (True, False):
        nodes = [start_node(f"n{same_host_ipc}{i}").address for i in range(2)]
        params, _ = run_offloaded(RunConfig(world_size=2, nodes=nodes, steps=6, extra={"same_host_ipc": same_host_ipc}))
        results.append(params)
    reference, _ = reference_averaged(2, fused=True, steps=6)
    assert max_difference(results[0], reference) == 0.0 and max_difference(results[1], reference) == 0.0


def test_a_same_host_socket_that_does_not_answer_leaves_the_worker_on_tcp(start_node, tmp_path):
    node = start_node(extra_args=("--no-same-host-ipc",))
    model = torch.nn.Linear(4, 2)
    opt = RemoteAdamW(model.parameters(), lr=0.1, nodes=[node.address], rank=0, world_size=1, timeout_s=2)
    session = opt._session
    with socket.socket(socket.AF_UNIX) as silent:  # accepts connections into its backlog, never speaks
        silent.bind(str(tmp_path / "silent.sock"))
        silent.listen()
        reply = session._connections._switch_to_same_host(0, f"ipc://{tmp_path / 'silent.sock'}", "test")
    assert reply.header.meta["owned"] == [0] and session.connection_addresses == [node.address]
    model(torch.ones(1, 4)).sum().backward()
    opt.step()  # the node answers this rank over TCP again
    assert opt.remote_step == 1
    opt.close()
