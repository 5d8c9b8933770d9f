"""The same-host fast path: a node on a tcp:// address also listens on an ipc:// socket, and a worker
on the same host moves to it after its HELLO."""

from __future__ import annotations

import copy
import json
import os
import socket

import pytest
import torch

from gpu_worker import RemoteAdamW, offload
from gpu_worker.links.connections import reachable_here as _reachable_here
from tests.gpu_worker.harness import RunConfig, average_in_rank_order, max_difference, reference_averaged, run_offloaded, run_threads
from tests.optimizer_node.test_metrics import scrape
from transport.batches import BATCH_BYTES


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


def _wide_model(width: int = 256) -> torch.nn.Sequential:
    """In buckets of 8,192 fp32 (32 KiB) every payload is large enough for the shared windows."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.Tanh(), torch.nn.Linear(width, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 64, generator=generator), torch.randn(4, 8, generator=generator)


def _torch_reference(width: int, steps: int, world_size: int) -> torch.nn.Sequential:
    """The model after ``steps`` of torch's fused AdamW fed every rank's gradients averaged in rank order."""
    reference = _wide_model(width)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(steps):
        grads = []
        for rank in range(world_size):
            replica = copy.deepcopy(reference)
            _loss(replica, step, rank).backward()
            grads.append([p.grad for p in replica.parameters()])
        for param, grad in zip(reference.parameters(), average_in_rank_order(grads), strict=True):
            param.grad = grad
        opt.step()
        opt.zero_grad()
    return reference


def _loss(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = _data(step, rank)
    return torch.nn.functional.mse_loss(model(x), y)


# A rank maps a node's board at its first receive after registering, so what it pulls before that
# comes through its window (a race with the board's offer). Later, layer-wise values (pulled unit by
# unit) all come off the board; a full-model job's do for buckets of BATCH_BYTES or more, while
# smaller ones leave in batches copied into each worker's window. The full-model case therefore
# has a 1 MiB bucket (the 64 x 4096 weight), which every step sends alone, off the board.
@pytest.mark.parametrize(
    ("layerwise", "width", "bucket_numel", "out_of_core"),
    [(False, 4096, 1 << 18, False), (True, 256, 8192, False), (False, 4096, 1 << 18, True), (True, 256, 8192, True)],
    ids=["full-model", "layer-wise", "full-model-out-of-core", "layer-wise-out-of-core"],
)
def test_training_through_the_shared_windows_is_bitwise_torch(start_node, tmp_path, layerwise, width, bucket_numel, out_of_core):
    """Two workers on the nodes' host, every gradient and parameter through shared memory: the same
    bits as torch's fused AdamW fed the same averaged gradients in one process. Out of core, with
    --same-host-board, the nodes' state goes through their files (a budget of two buckets) and the
    values through their boards, as in memory: a fetch of a bucket not in memory reads no file."""
    assert layerwise or 64 * width * 4 >= BATCH_BYTES, "a full-model job needs a bucket that is not batched"
    budget = 2 * 12 * bucket_numel

    def storage(i: int) -> tuple[str, ...]:
        return ("--state-dir", str(tmp_path / f"state{i}"), "--memory-budget", str(budget), "--same-host-board", "--metrics-port", "0")

    processes = [start_node(f"w{layerwise}{i}", extra_args=storage(i) if out_of_core else ()) for i in range(2)]
    nodes = [process.address for process in processes]
    steps, world_size = 4, 2
    finals: dict[int, list[torch.Tensor]] = {}
    moved: dict[int, dict[str, int]] = {}
    models = [_wide_model(width) for _ in range(world_size)]  # here, not in the threads: one global generator

    def worker(rank: int) -> None:
        model = models[rank]
        options = dict(lr=1e-2, weight_decay=0.1, nodes=nodes, rank=rank, world_size=world_size, bucket_numel=bucket_numel, timeout_s=60)
        opt = offload(model, [model[0], model[2], model[4]], **options) if layerwise else RemoteAdamW(model.parameters(), **options)
        for step in range(steps):
            _loss(model, step, rank).backward()
            opt.step()
            opt.zero_grad()
        moved[rank] = opt.shared_memory_bytes
        assert opt.device_copy_bytes == {"direct": 0, "staged": 0}, "a CPU worker copies nothing up to a device"
        finals[rank] = list(opt.gather_parameters().values())  # in the model's order
        opt.close()

    run_threads(worker, world_size)
    reference = _torch_reference(width, steps, world_size)
    for rank in range(world_size):
        assert moved[rank]["sent"] > 0 and moved[rank]["received"] > 0, f"rank {rank} moved nothing through shared memory: {moved[rank]}"
        # full model: every step's values of the unbatched bucket; layer-wise: every unit of every step
        # but the first (the rank maps each board before it pushes the first step's gradients)
        param_bytes = 4 * sum(p.numel() for p in reference.parameters())
        off_the_board = (steps - 1) * param_bytes if layerwise else steps * 64 * width * 4
        assert moved[rank]["board"] >= off_the_board, f"rank {rank} read too little from the nodes' boards: {moved[rank]}"
        # the nodes' windows hold a whole step of gradients: each is gathered there and sent with no
        # copy; only rank 0's initial values (a step's bytes) were copied into the windows
        copied_steps = 1 if rank == 0 else 0
        assert moved[rank]["sent_in_place"] * (steps + copied_steps) == moved[rank]["sent"] * steps, f"rank {rank}: {moved[rank]}"
        assert max_difference(finals[rank], [p.detach() for p in reference.parameters()]) == 0.0
    if out_of_core:
        # what the nodes read is their state for each update (12 bytes a parameter a step, less what the
        # budget kept) and the initial values' parameters (fetched before an update put them on the board),
        # not the parameters of every fetch as well (layer-wise: 2 workers x 2 fetches x 4 bytes a step)
        state_bytes = 12 * sum(p.numel() for p in reference.parameters())
        read = sum(scrape(process.metrics_url)["netoptim_state_read_bytes_total"] for process in processes)
        assert 0 < read <= (steps + 1) * state_bytes, f"{read} bytes read in {steps} steps of {state_bytes} bytes of state"


def test_an_out_of_core_node_takes_every_gradient_in_place_from_a_window_sized_to_a_step(start_node, tmp_path):
    """A node whose state does not fit its memory budget sizes its same-host workers' gradient windows
    to a step as a node in memory does (the memory plan counts those gradients either way): two
    workers' gradients all go through shared memory with no copy, and training stays bitwise torch."""
    model = _wide_model(4096)
    state_bytes = 12 * sum(p.numel() for p in model.parameters())
    budget = 6 << 20  # two buckets' state
    assert state_bytes > 2 * budget
    # 1 MiB windows: a step's gradients (5 MiB) fit only the window sized to them
    args = ("--state-dir", str(tmp_path / "state"), "--memory-budget", str(budget), "--same-host-window-mb", "1")
    nodes = [start_node("ooc", extra_args=args).address]
    steps, world_size = 3, 2
    models = [_wide_model(4096) for _ in range(world_size)]
    finals: dict[int, list[torch.Tensor]] = {}
    moved: dict[int, dict[str, int]] = {}

    def worker(rank: int) -> None:
        opt = RemoteAdamW(
            models[rank].parameters(), lr=1e-2, weight_decay=0.1, nodes=nodes, rank=rank, world_size=world_size, bucket_numel=1 << 18, timeout_s=60
        )
        for step in range(steps):
            _loss(models[rank], step, rank).backward()
            opt.step()
            opt.zero_grad()
        moved[rank] = opt.shared_memory_bytes
        finals[rank] = list(opt.gather_parameters().values())
        opt.close()

    run_threads(worker, world_size)
    reference = _torch_reference(4096, steps, world_size)
    step_bytes = 4 * sum(p.numel() for p in reference.parameters())
    for rank in range(world_size):
        # Every step after the first wholly in place (in the first, rank 0's initial values, copied
        # into its window, may still hold room when its gradients come); in a 1 MiB window a step's
        # 5 MiB could not be.
        assert moved[rank]["sent_in_place"] >= (steps - 1) * step_bytes, f"rank {rank}: {moved[rank]}"
        assert max_difference(finals[rank], [p.detach() for p in reference.parameters()]) == 0.0


def test_values_loaded_between_steps_replace_what_the_board_held(start_node):
    """Rank 0 loads parameters into the nodes between steps (``load_state_dict``): a worker that joins
    afterwards gets those, not the ones sent for that step before (the board tells them apart by the
    bucket's revision, which loading changes: tests/optimizer_node/test_state_transfer.py)."""
    nodes = [start_node("b0").address]
    options = dict(lr=1e-2, nodes=nodes, rank=0, world_size=1, bucket_numel=8192, timeout_s=60)
    model = _wide_model()
    opt = RemoteAdamW(model.parameters(), **options)
    for step in range(2):
        _loss(model, step, 0).backward()
        opt.step()
        opt.zero_grad()
    assert opt.shared_memory_bytes["board"] > 0
    saved = opt.state_dict()
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(0.5)
    opt.load_state_dict(saved)
    opt.close()
    fresh = _wide_model()  # a new process of rank 0: it takes the nodes' values of their step
    again = RemoteAdamW(fresh.parameters(), **options)
    assert again.remote_step == 2
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in fresh.parameters())
    again.close()


def test_a_node_started_without_the_board_sends_copies(start_node):
    nodes = [start_node("nb", extra_args=("--no-same-host-board",)).address]
    model = _wide_model()
    opt = RemoteAdamW(model.parameters(), lr=1e-2, nodes=nodes, rank=0, world_size=1, bucket_numel=8192, timeout_s=60)
    _loss(model, 0, 0).backward()
    opt.step()
    moved = opt.shared_memory_bytes
    assert moved["board"] == 0 and moved["received"] > 0
    opt.close()


def test_a_node_resumed_from_a_checkpoint_gives_its_same_host_workers_the_board_and_the_step_window(start_node, tmp_path):
    """--resume takes the checkpointed job back: the node that comes up serves it as the node that
    registered it did (parameter board, gradient windows sized to a step), not through copies and
    the socket."""
    checkpoints = str(tmp_path / "checkpoints")
    model = _wide_model(4096)

    def train(address: str, steps: int) -> dict[str, int]:
        opt = RemoteAdamW(model.parameters(), lr=1e-2, nodes=[address], bucket_numel=1 << 18, timeout_s=60)
        for step in range(steps):
            _loss(model, step, 0).backward()
            opt.step()
            opt.zero_grad()
        moved = opt.shared_memory_bytes
        opt.close()
        return moved

    # 1 MiB windows: a step's 5 MiB of gradients fit only a window sized to the step
    first = start_node("first", extra_args=("--checkpoint-dir", checkpoints, "--same-host-window-mb", "1"))
    train(first.address, 2)
    assert first.stop() == 0  # SIGTERM: a checkpoint of step 2
    resumed = start_node("resumed", extra_args=("--checkpoint-dir", checkpoints, "--resume", "--same-host-window-mb", "1"))
    assert "resumed from" in resumed.log_text()
    steps = 3
    moved = train(resumed.address, steps)
    step_bytes = 4 * sum(p.numel() for p in model.parameters())
    assert moved["board"] >= (steps - 1) * 4 * 4096 * 256, f"values read off the resumed node's board: {moved}"
    assert moved["sent_in_place"] >= (steps - 1) * step_bytes, f"gradients gathered in the resumed node's window: {moved}"
