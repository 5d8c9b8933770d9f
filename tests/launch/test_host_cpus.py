"""CPU placement: CPU lists, the host's NUMA nodes (read from a sysfs tree written here), disjoint
sets, and a real node pinned with ``--cpus``: every one of its threads, those it starts to serve a job
included, on the CPUs it was given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_worker import RemoteAdamW
from netoptim.launch.host_cpus import CpuPlacement, format_cpu_list, numa_nodes, parse_cpu_list, split_cpus, update_threads

USABLE = tuple(sorted(os.sched_getaffinity(0)))


@pytest.mark.parametrize(("text", "cpus"), [("0", (0,)), ("0-3,8,10-11", (0, 1, 2, 3, 8, 10, 11)), (" 3,1-2 ,\n", (1, 2, 3)), ("5,5,4-5", (4, 5))])
def test_cpu_lists_read_and_write_the_kernels_spelling(text, cpus):
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


def test_format_joins_runs():
    assert format_cpu_list([8, 0, 1, 2, 3, 10, 11]) == "0-3,8,10-11"


@pytest.mark.parametrize(("text", "message"), [("", "names no CPU"), ("a-b", "not a CPU list"), ("3-1", "not a CPU range"), ("-1", "not a CPU list")])
def test_malformed_cpu_lists_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_cpu_list(text)


def fake_numa(root: Path, cpulists: dict[int, str]) -> Path:
    """A sysfs node directory as the kernel lays it out (a memory-only node has an empty cpulist)."""
    for node, cpulist in cpulists.items():
        (root / f"node{node}").mkdir(parents=True)
        (root / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    (root / "possible").write_text("0-1\n")  # files beside the node directories are not nodes
    return root


def test_numa_nodes_keep_the_usable_cpus_of_each_node(tmp_path):
    root = fake_numa(tmp_path, {0: "0-3", 1: "4-7", 2: "", 10: "8-9"})
    assert numa_nodes(root, usable=range(10)) == {0: (0, 1, 2, 3), 1: (4, 5, 6, 7), 10: (8, 9)}
    assert numa_nodes(root, usable=[1, 2, 5]) == {0: (1, 2), 1: (5,)}  # a container's share
    assert numa_nodes(tmp_path / "absent") == {}


def test_split_keeps_numa_nodes_whole_where_the_counts_allow():
    nodes = {0: (0, 1, 2, 3, 4, 5, 6, 7), 1: (8, 9, 10, 11, 12, 13, 14, 15)}
    cpus = range(2, 16)  # two left to a worker
    assert split_cpus(cpus, 2, nodes) == [(2, 3, 4, 5, 6, 7), (8, 9, 10, 11, 12, 13, 14, 15)]
    assert split_cpus(cpus, 4, nodes) == [(2, 3, 4), (5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    three = split_cpus(cpus, 3, nodes)  # not a multiple of the nodes: consecutive runs, one straddles
    assert [len(part) for part in three] == [5, 5, 4] and sorted(sum(three, ())) == list(cpus)
    assert split_cpus(range(4), 2) == [(0, 1), (2, 3)]
    with pytest.raises(ValueError, match="at least 5 CPUs"):
        split_cpus(range(4), 5)


def test_placement_names_what_there_is_when_refused(tmp_path):
    assert CpuPlacement().resolve() is None
    assert CpuPlacement(cpus=format_cpu_list(USABLE[:1])).resolve() == USABLE[:1]
    with pytest.raises(ValueError, match=rf"CPU {max(USABLE) + 1} is not among those this process may use \({format_cpu_list(USABLE)}\)"):
        CpuPlacement(cpus=str(max(USABLE) + 1)).resolve()
    root = fake_numa(tmp_path, {0: format_cpu_list(USABLE)})
    assert CpuPlacement(numa_node=0).resolve(root) == USABLE
    with pytest.raises(ValueError, match=rf"NUMA node 1 has no CPU .* 0 \(CPUs {format_cpu_list(USABLE)}\)"):
        CpuPlacement(numa_node=1).resolve(root)
    with pytest.raises(ValueError, match="not both"):
        CpuPlacement(cpus="0", numa_node=0).resolve(root)


def test_pin_process_moves_the_threads_already_running_and_those_started_later():
    code = """
import os, sys, threading
from pathlib import Path
from netoptim.launch.host_cpus import pin_process
gate = threading.Event()
before = threading.Thread(target=gate.wait); before.start()
pin_process({int(sys.argv[1])})
after = threading.Thread(target=gate.wait); after.start()
masks = {int(t.name): os.sched_getaffinity(int(t.name)) for t in Path("/proc/self/task").iterdir()}
gate.set(); before.join(); after.join()
print(sorted({tuple(sorted(m)) for m in masks.values()}), len(masks))
"""
    result = subprocess.run([sys.executable, "-c", code, str(USABLE[-1])], capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [f"[({USABLE[-1]},)]", "3"]


def cpus_of_every_thread(pid: int) -> set[str]:
    masks = set()
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            masks.update(line.split(":", 1)[1].strip() for line in status.read_text().splitlines() if line.startswith("Cpus_allowed_list"))
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return masks


def test_a_node_leaves_one_of_four_or_more_cpus_to_its_io():
    assert [update_threads(cpus) for cpus in (1, 2, 3, 4, 14, 64)] == [1, 2, 3, 3, 13, 63]
    # --pass-thread: the serve loop runs beside the passes, on a CPU of its own
    assert [update_threads(cpus, pass_thread=True) for cpus in (1, 3, 4, 14)] == [1, 3, 2, 12]
    with pytest.raises(ValueError, match="at least one CPU"):
        update_threads(0)


def test_an_out_of_core_node_leaves_its_store_threads_cpus_while_the_passes_keep_half():
    # 2 readers and 2 writers (--state-io-threads 2) beside the loop: 14 CPUs give the passes 9
    assert [update_threads(cpus, store_io_threads=4) for cpus in (2, 4, 8, 14, 64)] == [2, 2, 4, 9, 59]
    assert update_threads(14, pass_thread=True, store_io_threads=6) == 7
    assert update_threads(3, store_io_threads=4) == 3  # below 4 CPUs nothing is left free, as in memory
    with pytest.raises(ValueError, match="store_io_threads"):
        update_threads(8, store_io_threads=-1)


def test_a_node_pinned_with_cpus_serves_a_job_with_every_thread_on_them(start_node):
    cpu = USABLE[-1]
    node = start_node(extra_args=("--cpus", str(cpu)))
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = RemoteAdamW(model.parameters(), nodes=[node.address], rank=0, world_size=1, lr=1e-2, timeout_s=60)
    try:
        for _ in range(2):  # the node's update threads start with its first updates
            model(torch.randn(8, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        opt.close()
    assert cpus_of_every_thread(node.process.pid) == {str(cpu)}
    assert f"torch threads: 1; CPUs: {cpu}; update threads between passes: " in node.log_text()
