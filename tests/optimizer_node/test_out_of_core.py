"""Out-of-core nodes as a whole: the memory budget measured on a running node, and jobs a node
cannot hold refused with what to change."""

from __future__ import annotations

import os
import subprocess

import grpc
import pytest
import torch
from google.protobuf.json_format import MessageToDict

from gpu_worker import NodeError, RemoteAdamW, offload
from gpu_worker.models import GPT, GPTConfig, gpt_initializer
from netoptim.cli.admin import _render_status
from optimizer_node.config import NodeConfig
from optimizer_node.state.memory_plan import node_needs
from protos import admin_pb2, admin_pb2_grpc
from tests.optimizer_node.test_metrics import scrape
from transport.host_threads import MAIN_THREAD, thread_cpu_seconds

JOB_OVERHEAD = 40 << 20


def rss_bytes(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


@pytest.mark.fresh_nodes
def test_node_memory_stays_within_its_budget(start_node, tmp_path):
    """96 MiB of state through a 24 MiB budget; the node's peak RSS above its idle size is measured."""
    budget = 24 << 20
    node = start_node(extra_args=("--state-dir", str(tmp_path / "state"), "--memory-budget", str(budget)))
    idle = rss_bytes(node.process.pid, "VmRSS")
    config = GPTConfig(vocab_size=256, block_size=32, n_layer=8, n_head=4, n_embd=256)
    with torch.device("meta"):
        model = GPT(config)
    window = 4 << 20
    opt = offload(model, model.blocks, nodes=[node.address], init_fn=gpt_initializer(config), bucket_numel=1 << 18, push_window_bytes=window, timeout_s=60)
    state_bytes = 12 * sum(p.numel() for p in model.parameters())
    assert state_bytes > 3 * budget
    for step in range(2):
        tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(step))
        _, loss = model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        loss.backward()
        opt.step()
    opt.gather_parameters()
    peak = rss_bytes(node.process.pid, "VmHWM") - idle
    print(f"\nstate {state_bytes / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB, node peak RSS above idle {peak / 2**20:.1f} MiB")
    opt.close()
    # The budget bounds the state. On top: the gradients a worker may have in flight (its push
    # window) and the fixed cost of serving a job (kernel and thread start-up, I/O threads, message
    # frames: ~30 MiB measured with all state in memory).
    assert peak <= 1.1 * budget + window + JOB_OVERHEAD


def test_status_and_metrics_say_where_the_state_is_and_what_moved_to_and_from_the_disk(start_node, tmp_path):
    budget = 3 << 20  # 4 buckets' state
    args = ("--state-dir", str(tmp_path / "state"), "--memory-budget", str(budget), "--admin", "127.0.0.1:0", "--metrics-port", "0")
    node = start_node(extra_args=args)
    config = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=4, n_embd=128)
    with torch.device("meta"):
        model = GPT(config)
    opt = offload(model, model.blocks, nodes=[node.address], init_fn=gpt_initializer(config), bucket_numel=1 << 16, timeout_s=60)
    for step in range(2):
        tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(step))
        model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())[1].backward()
        opt.step()
    opt.gather_parameters()
    with grpc.insecure_channel(node.admin_address) as channel:
        status = admin_pb2_grpc.OptimizerNodeAdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(), timeout=30)
    assert status.bytes_owned > 3 * budget
    assert status.bytes_on_disk == status.bytes_owned, "every bucket's newest version is in its file (the state does not fit the budget)"
    assert status.bytes_in_ram <= budget < status.bytes_owned  # what is resident now (written back and freed at rest: maybe none)
    shown = _render_status(MessageToDict(status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))
    assert f"MiB in RAM, {status.bytes_on_disk / 2**20:.1f} MiB on disk)" in shown
    values = scrape(node.metrics_url)
    assert values["netoptim_state_read_bytes_total"] >= 2 * status.bytes_owned / 3, "every update read its state back (the parameters of some were in memory)"
    assert values["netoptim_state_written_bytes_total"] >= 2 * status.bytes_owned
    # the store's threads carry OS names, so a node's CPU can be told apart by thread (top -H, the benchmarks)
    threads = thread_cpu_seconds(node.process.pid)
    assert {MAIN_THREAD, "netoptim-read", "netoptim-write", "admin"} <= threads.keys(), threads
    opt.close()


def test_a_budget_below_two_buckets_is_refused_with_what_to_change(start_node, tmp_path):
    node = start_node(extra_args=("--state-dir", str(tmp_path / "state"), "--memory-budget", "16KiB"))
    model = torch.nn.Linear(64, 64)
    with pytest.raises(NodeError, match=r"CANNOT_FIT.*memory-budget .* is less than two buckets .*raise it"):
        RemoteAdamW(model.parameters(), nodes=[node.address], bucket_numel=1024, timeout_s=10)


def test_a_job_larger_than_the_nodes_ram_is_refused_before_anything_is_allocated(start_node):
    node = start_node()
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=40, n_head=32, n_embd=4096))  # 8B parameters
    with pytest.raises(NodeError, match=r"CANNOT_FIT.*needs about .* GiB of RAM.*--state-dir DIR --memory-budget SIZE"):
        offload(model, model.blocks, nodes=[node.address], init_fn=gpt_initializer(model.config), timeout_s=10)
    assert "stopped" not in node.log_text() and node.process.poll() is None


@pytest.fixture
def small_disk(tmp_path):
    """A real 4 MiB filesystem."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.strip()}")
    yield mount_point
    # lazily: this runs before start_node's teardown stops the node, whose state files there are still
    # open, and a plain umount then failed ("target is busy") and left the mount behind
    subprocess.run(["umount", "--lazy", str(mount_point)], check=True)


def test_a_full_state_disk_stalls_training_with_a_clear_error_and_loses_nothing(start_node, small_disk):
    """The disk fills up under a training node: updates stop, workers time out naming the storage
    error; once the operator frees space the held updates are applied and training ends where a
    roomy run ends. A node writes each next version into the retired version's file, which needs no
    room; what does is a version a checkpoint holds on to, so the disk fills after a checkpoint."""
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
    budget = 2 * 12 * 4096

    def connect(node, timeout_s: float):
        torch.manual_seed(0)
        model = GPT(config)
        return model, offload(model, model.blocks, nodes=[node.address], bucket_numel=4096, timeout_s=timeout_s, lr=1e-2)

    def train(model, opt, steps: int) -> None:
        for step in range(opt.remote_step, steps):
            tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(step))
            model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())[1].backward()
            opt.step()

    model, opt = connect(start_node("roomy", extra_args=("--state-dir", str(small_disk.parent / "roomy"), "--memory-budget", str(budget))), 30)
    train(model, opt, 3)
    roomy = opt.gather_parameters()
    opt.close()

    checkpoints = ("--checkpoint-dir", str(small_disk / "checkpoints"), "--admin", "127.0.0.1:0")
    node = start_node("cramped", extra_args=("--state-dir", str(small_disk / "state"), "--memory-budget", str(budget), *checkpoints))
    model, opt = connect(node, 3)
    admin = admin_pb2_grpc.OptimizerNodeAdminStub(grpc.insecure_channel(node.admin_address))
    assert admin.Checkpoint(admin_pb2.CheckpointRequest(), timeout=30).step == 0  # links every bucket's file: the next versions need room
    filler = small_disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)  # take every byte left: the next state versions have nowhere to go
    try:
        while os.write(fd, b"x" * 4096):
            pass
    except OSError:
        pass
    os.close(fd)
    with pytest.raises(TimeoutError, match=r"its state storage fails: .*No space left on device; free space there"):
        train(model, opt, 3)
    opt.close()
    assert node.process.poll() is None, "the node keeps running"
    filler.unlink()
    model, opt = connect(node, 30)
    train(model, opt, 3)
    assert all(torch.equal(value, roomy[name]) for name, value in opt.gather_parameters().items())
    opt.close()


def test_a_board_out_of_core_counts_in_the_nodes_ram_beside_the_budget():
    """--same-host-board out of core: two slots a bucket in the wire dtype on top of the budget (the
    node checks the host's available memory against this before it makes one)."""
    plain = node_needs(1_000_000, workers=2, memory_budget=64 << 20)
    with_board = node_needs(1_000_000, workers=2, memory_budget=64 << 20, board=True)
    assert plain.ram_out_of_core is not None and with_board.ram_out_of_core is not None
    assert with_board.ram_out_of_core - plain.ram_out_of_core == 2 * 4 * 1_000_000
    assert NodeConfig(state_dir="/tmp/x", memory_budget=1 << 20).board_wanted is False, "not by default out of core"
    assert NodeConfig(state_dir="/tmp/x", memory_budget=1 << 20, same_host_board=True).board_wanted is True
    assert NodeConfig().board_wanted is True and NodeConfig(same_host_board=False).board_wanted is False
    # the store's readers and writers, which a pinned node's update threads leave CPUs to
    assert NodeConfig(state_dir="/tmp/x", memory_budget=1 << 20, state_io_threads=3).store_io_threads == 6
    assert NodeConfig(state_io_threads=3).store_io_threads == 0
