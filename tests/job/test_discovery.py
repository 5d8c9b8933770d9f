"""The node list a worker resolves (gpu_worker/discovery.py): explicit lists, host files, the environment,
and rank 0's list shared through a c10d store."""

from __future__ import annotations

import itertools
import logging
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gpu_worker.discovery import (
    NODE_FILE_ENV,
    NODES_ENV,
    NodeList,
    agent_store_address,
    check_address,
    discover_nodes,
    nodes_option,
    parse_host_file,
    resolve_nodes,
    share_nodes,
)

A, B, C = "tcp://10.0.0.11:5555", "tcp://10.0.0.12:5555", "ipc:///run/netoptim/node2.sock"


def host_file(tmp_path: Path, text: str, name: str = "nodes.txt") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_host_file_with_comments_and_blank_lines(tmp_path):
    path = host_file(tmp_path, f"# optimizer nodes of job 7\n\n  {A}  \n{B} # the second CPU host\n\t\n{C}\n")
    assert resolve_nodes(path, environ={}) == NodeList((A, B, C), f"host file {path}")
    assert resolve_nodes(str(path), environ={}).addresses == (A, B, C)  # a str is a path too
    assert parse_host_file(f"{B}#no blank needed\r\n{A}\r\n", "where.txt") == (B, A)  # CRLF files too


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        (f"{A}\n10.0.0.12:5555\n", 2, "needs a scheme"),
        (f"# nodes\n{A}\n\nudp://10.0.0.12:5555\n", 4, "unsupported scheme"),
        ("tcp://10.0.0.11\n", 1, "needs a host and a port"),
        ("tcp://10.0.0.11:0\n", 1, "port from 1 to 65535"),
        ("tcp://10.0.0.11:70000\n", 1, "port from 1 to 65535"),
        (f"{A} {B}\n", 1, "holds a blank"),
        (f"{A}\n{B}\n{A}\n", 3, "listed twice"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, text, line, reason):
    path = host_file(tmp_path, text)
    with pytest.raises(ValueError, match=rf"^{path}:{line}: .*{reason}"):
        resolve_nodes(path, environ={})


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(ValueError, match=r"cannot read the host file .*absent\.txt: No such file"):
        resolve_nodes(tmp_path / "absent.txt", environ={})
    for text in ("", "\n\n", "# nothing yet\n  # still nothing\n"):
        path = host_file(tmp_path, text)
        with pytest.raises(ValueError, match=rf"host file {path} lists no node"):
            resolve_nodes(path, environ={})
    with pytest.raises(ValueError, match=r"cannot read the host file .*: Is a directory"):
        resolve_nodes(tmp_path, environ={})


def test_environment_and_precedence(tmp_path, caplog):
    path = host_file(tmp_path, f"{C}\n")
    assert resolve_nodes(environ={NODES_ENV: f" {A}, {B} ,"}) == NodeList((A, B), NODES_ENV)
    assert resolve_nodes(environ={NODE_FILE_ENV: str(path)}) == NodeList((C,), f"host file {path} (${NODE_FILE_ENV})")
    with caplog.at_level(logging.WARNING, logger="gpu_worker.discovery"):
        assert resolve_nodes(environ={NODES_ENV: A, NODE_FILE_ENV: str(path)}).addresses == (A,)
    assert f"ignoring the host file {path}" in caplog.text
    # The nodes argument wins over both; empty variables count as unset.
    assert resolve_nodes([B], environ={NODES_ENV: A, NODE_FILE_ENV: str(path)}).addresses == (B,)
    assert resolve_nodes(path, environ={NODES_ENV: A}).addresses == (C,)
    assert resolve_nodes(environ={NODES_ENV: " ", NODE_FILE_ENV: str(path)}).addresses == (C,)
    with pytest.raises(ValueError, match=f"no optimizer nodes given: .*{NODES_ENV}.*{NODE_FILE_ENV}"):
        resolve_nodes(environ={NODES_ENV: "", NODE_FILE_ENV: ""})
    with pytest.raises(ValueError, match=f"{NODES_ENV} entry 2: address 'tcp://10.0.0.12' needs a host and a port"):
        resolve_nodes(environ={NODES_ENV: f"{A},tcp://10.0.0.12"})
    with pytest.raises(ValueError, match=f"cannot read the host file {tmp_path}/gone.txt"):
        resolve_nodes(environ={NODE_FILE_ENV: str(tmp_path / "gone.txt")})


def test_explicit_lists():
    assert resolve_nodes([A, B], environ={NODES_ENV: C}) == NodeList((A, B), "the nodes argument")
    with pytest.raises(ValueError, match="non-empty list of addresses"):
        resolve_nodes([])
    with pytest.raises(ValueError, match=r"non-empty list of addresses .* give addresses as a list"):
        resolve_nodes(A)  # one address as a str: not a host file
    with pytest.raises(TypeError, match="list of address strings"):
        resolve_nodes([A, 5])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="list of address strings"):
        resolve_nodes(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"nodes\[1\]: .*listed twice \(also nodes\[0\]\)"):
        resolve_nodes([A, A])
    assert check_address(" tcp://[::1]:5555 ") == "tcp://[::1]:5555"
    assert check_address("mooncake+rdma://10.0.0.11:6000") == "mooncake+rdma://10.0.0.11:6000"


def test_nodes_option():
    assert nodes_option(None) is None and nodes_option(" ") is None
    assert nodes_option(f"{A},{B}") == [A, B]
    assert nodes_option(A) == [A]
    assert nodes_option(" /shared/job7/nodes.txt ") == "/shared/job7/nodes.txt"


def test_agent_store_address():
    torchrun = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2"}
    assert agent_store_address(torchrun) == ("127.0.0.1", 29500, 1)
    assert agent_store_address({**torchrun, "WORLD_SIZE": "1"}) is None  # one worker: nobody to share with
    assert agent_store_address({**torchrun, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert agent_store_address({**torchrun, "MASTER_PORT": "not-a-port"}) is None
    assert agent_store_address({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2"}) is None  # not torchrun


def share_from_threads(store: dist.Store, resolvers: list, timeout_s: float = 10.0) -> list:
    """Each rank's result (or exception) of share_nodes, the ranks running as threads on one store."""
    results: list = [None] * len(resolvers)

    def run(rank: int) -> None:
        try:
            results[rank] = share_nodes(store, rank, resolvers[rank], key="netoptim/nodes/test/0/0", timeout_s=timeout_s)
        except Exception as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in reversed(range(len(resolvers)))]  # readers first
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def test_rank_0_publishes_and_every_rank_agrees(tmp_path):
    rank0 = host_file(tmp_path, f"{A}\n{B}\n", "rank0.txt")
    other = host_file(tmp_path, f"{B}\n{A}\n", "other.txt")  # the other host's file differs: not read
    resolvers = [lambda: resolve_nodes(rank0, environ={})] + [lambda: resolve_nodes(other, environ={})] * 2
    results = share_from_threads(dist.HashStore(), resolvers)
    assert results[0] == NodeList((A, B), f"host file {rank0}")
    assert results[1] == results[2] == NodeList((A, B), f"rank 0 (host file {rank0})")


def test_rank_0_error_reaches_the_other_ranks(tmp_path):
    missing = tmp_path / "absent.txt"
    results = share_from_threads(dist.HashStore(), [lambda: resolve_nodes(missing, environ={})] * 2)
    assert isinstance(results[0], ValueError) and "cannot read the host file" in str(results[0])
    assert isinstance(results[1], ValueError)
    assert str(results[1]).startswith(f"rank 1: rank 0 could not find the optimizer nodes: cannot read the host file {missing}")


def test_a_rank_without_rank_0_times_out_clearly():
    store = dist.HashStore()
    with pytest.raises(TimeoutError, match=r"rank 1: rank 0 did not publish the optimizer nodes within 0.3 s .*is rank 0 running"):
        share_nodes(store, 1, lambda: NodeList((A,), "unused"), key="netoptim/nodes/x/0/0", timeout_s=0.3)


def test_tcp_store_between_processes_roles(tmp_path):
    """The same exchange over a real TCPStore on loopback, as torchrun's agent serves it."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    path = host_file(tmp_path, f"{B}\n")
    reader = threading.Thread(target=lambda: results.append(share_nodes(client, 1, lambda: NodeList((), ""), key="k", timeout_s=10)))
    results: list[NodeList] = []
    reader.start()
    share_nodes(server, 0, lambda: resolve_nodes(path, environ={}), key="k", timeout_s=10)
    reader.join(20)
    assert results == [NodeList((B,), f"rank 0 (host file {path})")]


def test_discover_through_torchruns_store(tmp_path, monkeypatch):
    """Rank 1 as torchrun starts it, without a process group: it reads rank 0's list from the store
    its variables name (here a TCPStore on loopback standing in for torchrun's agent)."""
    monkeypatch.setattr("gpu_worker.discovery._published", itertools.count())  # this process's first list: .../0
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    share_nodes(server, 0, lambda: NodeList((B, A), "host file x"), key="netoptim/nodes/job7/1/0", timeout_s=10)
    torchrun = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "1"}
    environ = {**torchrun, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "RANK": "1", "WORLD_SIZE": "2"}
    assert discover_nodes(None, environ=environ, timeout_s=10) == [B, A]
    assert discover_nodes([C], environ=environ) == [C]  # a list is used as given: no store
    with pytest.raises(TimeoutError, match=r"rank 1: rank 0 did not publish .* \(key 'netoptim/nodes/job7/1/1'\)"):
        discover_nodes(str(tmp_path / "only-on-rank-0.txt"), environ=environ, timeout_s=0.3)


def test_discover_with_a_process_group(tmp_path):
    """An initialized process group of one: no store traffic; a list is used as given either way."""
    path = host_file(tmp_path, f"{A}\n{C}\n")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        assert discover_nodes(str(path), environ={}) == [A, C]
        assert discover_nodes(None, environ={NODES_ENV: B}) == [B]
        assert discover_nodes([C, A], environ={NODES_ENV: B}) == [C, A]
    finally:
        dist.destroy_process_group()


def test_remote_adamw_reports_a_bad_host_file(tmp_path, monkeypatch):
    from gpu_worker import RemoteAdamW

    monkeypatch.delenv(NODES_ENV, raising=False)
    monkeypatch.setenv(NODE_FILE_ENV, str(host_file(tmp_path, f"{A}\nnot-an-address\n")))
    params = list(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match=r"nodes.txt:2: address 'not-an-address' needs a scheme"):
        RemoteAdamW(params, rank=0, world_size=1)
    monkeypatch.delenv(NODE_FILE_ENV)
    with pytest.raises(ValueError, match="no optimizer nodes given"):
        RemoteAdamW(params, rank=0, world_size=1)
