"""A multi-host launch on one machine: two ``torchrun --nnodes 2`` invocations (one per emulated
host, c10d rendezvous on loopback) whose workers find the optimizer nodes through rank 0's host
file and the rendezvous store, against real node daemons; the result is bitwise the one of the
same job given an explicit node list."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from gpu_worker.discovery import NODE_FILE_ENV, NODES_ENV
from netoptim.launch.processes import NodeProcess, free_port
from tests.launch.discovery_worker import build_model, train

pytestmark = pytest.mark.slow  # ~20 s a case on 2 busy cores: 2 launchers, 2 workers and 2 nodes, each importing torch

WORKER = str(Path(__file__).with_name("discovery_worker.py"))
TIMEOUT_S = 180


def start_nodes(workdir: Path, names: list[str]) -> list[NodeProcess]:
    nodes = [NodeProcess(workdir, name=name, log_level="WARNING") for name in names]
    with ThreadPoolExecutor(len(nodes)) as pool:  # in parallel: each imports torch
        list(pool.map(NodeProcess.start, nodes))
    return nodes


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[list[str], dict[str, torch.Tensor]]:
    """The job with an explicit node list, its two ranks as threads here: (the list, rank 0's parameters)."""
    nodes = start_nodes(tmp_path_factory.mktemp("reference"), ["r0", "r1"])
    explicit = [nodes[1].address, nodes[0].address]
    models = [build_model() for _ in range(2)]
    results: list = [None, None]

    def rank(r: int) -> None:
        try:
            results[r] = train(models[r], explicit, r, 2)
        except Exception as exc:
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT_S)
    finally:
        for node in nodes:
            node.stop()
    assert results == [explicit, explicit], results
    assert all(torch.equal(a, b) for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values(), strict=True))
    return explicit, models[0].state_dict()


def worker_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in (NODES_ENV, NODE_FILE_ENV)}
    return {**env, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **extra}


def torchrun_hosts(workdir: Path, script_args: list[str], host_env: list[dict[str, str]]) -> list[subprocess.Popen]:
    """One ``torchrun`` per emulated host, as on two machines: ``--nnodes 2``, one worker each, the
    c10d rendezvous hosted by the first; every address is loopback (``--local-addr``)."""
    endpoint = f"127.0.0.1:{free_port()}"
    processes = []
    for host, env in enumerate(host_env):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "netoptim-launch-test", "--rdzv-conf", f"is_host={int(host == 0)}",
            "--local-addr", "127.0.0.1", "--max-restarts", "0", "--monitor-interval", "0.2", WORKER, *script_args,
        ]  # fmt: skip
        with open(workdir / f"host{host}.log", "wb") as log:
            processes.append(subprocess.Popen(command, env=worker_env(**env), stdout=log, stderr=subprocess.STDOUT))
    return processes


def wait_all(processes: list[subprocess.Popen], logs: list[Path]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in processes):
            break  # one failed: the other would wait for it
        time.sleep(0.2)
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
    failed = [(i, p.returncode) for i, p in enumerate(processes) if p.returncode != 0]
    assert not failed, "\n\n".join(f"launcher {i} exited with {code}:\n{logs[i].read_text(errors='replace')[-4000:]}" for i, code in failed)


@pytest.mark.parametrize("process_group", [False, True], ids=["torchrun-store", "process-group-store"])
def test_two_torchrun_hosts_find_the_nodes_through_rank_0(tmp_path, reference, process_group):
    nodes = start_nodes(tmp_path, ["n0", "n1"])
    order = [nodes[1].address, nodes[0].address]
    try:
        # Each host's NETOPTIM_NODE_FILE names a file of its own, and only rank 0's host has one.
        # torch's c10d rendezvous ranks the hosts by (address, pid), and both are 127.0.0.1 here:
        # rank 0 is on the launcher with the lower pid. Its file is written now, seconds before
        # its worker reads it; the other host's never exists.
        hosts = [{NODE_FILE_ENV: str(tmp_path / f"host{h}-nodes.txt")} for h in range(2)]
        args = ["--report", str(tmp_path / "report"), *(["--process-group"] if process_group else [])]
        launchers = torchrun_hosts(tmp_path, args, hosts)
        rank0_host = min(range(2), key=lambda h: launchers[h].pid)
        (tmp_path / f"host{rank0_host}-nodes.txt").write_text("# optimizer nodes\n" + "\n".join(order) + "\n")
        wait_all(launchers, [tmp_path / "host0.log", tmp_path / "host1.log"])
    finally:
        for node in nodes:
            node.stop()
    used = [json.loads((tmp_path / "report" / f"rank{r}.json").read_text())["nodes"] for r in range(2)]
    assert used == [order, order]  # rank 1 read no file: it took rank 0's list, in its order
    assert "rank 1 uses rank 0's 2 optimizer node(s)" in (tmp_path / f"host{1 - rank0_host}.log").read_text()
    explicit, expected = reference
    assert len(explicit) == len(order)
    for r in range(2):
        state = torch.load(tmp_path / "report" / f"rank{r}.pt")
        assert state.keys() == expected.keys()
        assert all(torch.equal(state[name], expected[name]) for name in expected), f"rank {r} differs from the explicit-list run"
