"""A node killed at the worst moments, restarted with --resume: training continues and ends bitwise
where an uninterrupted run ends (nothing lost, nothing applied twice)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import grpc
import pytest
import torch

from gpu_worker import RemoteAdamW
from netoptim import console
from optimizer_node.faults import EXIT_STATUS
from protos import admin_pb2, admin_pb2_grpc
from tests.gpu_worker.harness import run_threads
from tests.ports import restartable_address

STEPS = 8
WORLD = 2


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4))  # 316 params: 3 buckets of 128


def train(address: str | list[str], steps: int = STEPS, **options) -> tuple[list[torch.Tensor] | None, list[BaseException]]:
    """Worker threads that resume at the nodes' step; returns rank 0's parameters (None if a rank failed).
    ``address``: one node's, or a list of nodes; ``options`` go to ``RemoteAdamW`` (default ``timeout_s=30``)."""
    options.setdefault("timeout_s", 30)
    nodes = [address] if isinstance(address, str) else list(address)
    models = [make_model() for _ in range(WORLD)]
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            mine = dict(options, module=models[rank]) if options.get("overlap_forward") else options
            opt = RemoteAdamW(models[rank].parameters(), lr=0.05, nodes=nodes, rank=rank, world_size=WORLD, bucket_numel=128, **mine)
            for step in range(opt.remote_step, steps):
                generator = torch.Generator().manual_seed(step * WORLD + rank)
                models[rank](torch.randn(4, 8, generator=generator)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            opt.synchronize()  # overlap_forward: the last step's values are in
            results[rank] = [p.detach().clone() for p in models[rank].parameters()]
            opt.close()
        except BaseException as exc:
            errors.append(exc)

    run_threads(worker, WORLD)
    return (results.get(0) if not errors else None), errors


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    from netoptim.launch.processes import NodeProcess

    with NodeProcess(tmp_path_factory.mktemp("reference")) as node:
        params, errors = train(node.address)
    assert not errors
    return params


@pytest.mark.parametrize(
    ("crash_at", "out_of_core"),
    [
        # kills during a push are drilled at every crash point by tests/faults/test_node_restarts.py
        pytest.param("push:20", False, id="during-a-push", marks=pytest.mark.slow),
        pytest.param("update:5", False, id="during-an-update"),
        pytest.param("checkpoint:4", False, id="during-a-checkpoint-write"),
        pytest.param("update:5", True, id="out-of-core-during-an-update"),
        pytest.param("checkpoint:4", True, id="out-of-core-during-a-checkpoint-write", marks=pytest.mark.slow),  # the in-memory one stays
    ],
)
def test_resume_after_a_crash_ends_where_an_uninterrupted_run_ends(start_node, tmp_path, uninterrupted, crash_at, out_of_core):
    checkpoints = str(tmp_path / "checkpoints")
    # Out of core: a budget of two of the three buckets, so state really goes through its files.
    storage = ("--state-dir", str(tmp_path / "state"), "--memory-budget", str(2 * 128 * 12)) if out_of_core else ()
    node = start_node(
        "doomed", listen=restartable_address(), extra_args=("--checkpoint-dir", checkpoints, "--checkpoint-every", "2", "--crash-at", crash_at, *storage)
    )
    # The node does not come back on its own; the lost connection, not the timeout, tells the workers.
    params, errors = train(node.address, timeout_s=30, reconnect_s=2)
    assert params is None and errors, "the node should have died mid-training"
    assert node.process.wait(10) == EXIT_STATUS
    resumed = start_node("resumed", extra_args=("--checkpoint-dir", checkpoints, "--checkpoint-every", "2", "--resume", *storage))
    assert "resumed from" in resumed.log_text()
    params, errors = train(resumed.address)
    assert not errors, errors
    assert all(torch.equal(a, b) for a, b in zip(params, uninterrupted, strict=True))


def test_sigterm_checkpoints_and_a_damaged_newest_checkpoint_is_skipped(start_node, tmp_path, uninterrupted):
    checkpoints = tmp_path / "checkpoints"
    node = start_node("first", extra_args=("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2"))
    train(node.address, steps=5)
    assert node.stop() == 0
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-0000000002", "step-0000000004", "step-0000000005"]  # SIGTERM wrote step 5
    damaged = checkpoints / "step-0000000005" / "bucket-000001.bin"
    damaged.write_bytes(b"\0" * damaged.stat().st_size)
    resumed = start_node("second", extra_args=("--checkpoint-dir", str(checkpoints), "--resume"))
    log = resumed.log_text()
    assert "skipping checkpoint step-0000000005" in log and "does not match its checksum" in log and "step 4" in log
    params, errors = train(resumed.address)
    assert not errors and all(torch.equal(a, b) for a, b in zip(params, uninterrupted, strict=True))


def test_checkpoint_and_drain_through_admin(start_node, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    node = start_node(extra_args=("--checkpoint-dir", str(checkpoints), "--admin", "127.0.0.1:0"))
    stub = admin_pb2_grpc.OptimizerNodeAdminStub(grpc.insecure_channel(node.admin_address))
    with pytest.raises(grpc.RpcError) as info:
        stub.Checkpoint(admin_pb2.CheckpointRequest(), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no job" in info.value.details()
    train(node.address, steps=2)
    reply = stub.Checkpoint(admin_pb2.CheckpointRequest(), timeout=30)
    manifest = json.loads(reply.manifest_json)
    assert reply.step == 2 and reply.path.endswith("step-0000000002") and len(manifest["files"]) == 3
    assert manifest["origin"] == "manual"  # taken by hand: --keep never prunes it

    assert stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=30).job_state == "finished"  # every rank closed its optimizer
    train(node.address, steps=3)
    drained = stub.Drain(admin_pb2.DrainRequest(), timeout=30)
    assert drained.step == 3 and (checkpoints / "step-0000000003" / "manifest.json").exists()
    status = stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=30)
    assert status.job_state == "drained" and status.drain_step == 3
    _, errors = train(node.address, steps=4, timeout_s=5)
    assert errors and "DRAINING" in str(errors[0])
    stub.Resume(admin_pb2.ResumeRequest(), timeout=30)  # a drain is undone like a pause
    assert stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=30).job_state in ("training", "finished")  # finished once the refused ranks' BYEs are in
    _, errors = train(node.address, steps=4)
    assert not errors and stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=30).step == 4
    node.process.send_signal(signal.SIGTERM)
    assert node.process.wait(20) == 0


@pytest.fixture
def tiny_disk(tmp_path):
    """A 24 KiB filesystem: room for one checkpoint of the test model, not two."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24k", "tmpfs", str(mount_point)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=False)


def test_a_full_disk_fails_the_checkpoint_not_the_node(start_node, tiny_disk):
    node = start_node(extra_args=("--checkpoint-dir", str(tiny_disk), "--admin", "127.0.0.1:0"))
    stub = admin_pb2_grpc.OptimizerNodeAdminStub(grpc.insecure_channel(node.admin_address))
    train(node.address, steps=2)
    assert stub.Checkpoint(admin_pb2.CheckpointRequest(), timeout=30).step == 2
    train(node.address, steps=3)
    with pytest.raises(grpc.RpcError) as info:
        stub.Checkpoint(admin_pb2.CheckpointRequest(), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "No space left on device" in info.value.details()
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["latest", "step-0000000002"]  # no half-written leftovers
    _, errors = train(node.address, steps=4)  # the node keeps its state and keeps training
    assert not errors and stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=10).step == 4


def test_export_merges_the_nodes_into_a_loadable_state_dict(start_node, tmp_path, caplog):
    roots = [tmp_path / f"node{i}" for i in range(2)]
    nodes = [start_node(f"node{i}", extra_args=("--checkpoint-dir", str(root))) for i, root in enumerate(roots)]
    model = make_model()
    named = dict(model.named_parameters())
    opt = RemoteAdamW(model.named_parameters(), lr=0.05, nodes=[n.address for n in nodes], rank=0, world_size=1, bucket_numel=128)
    for step in range(3):
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    for node in nodes:
        assert node.stop() == 0  # SIGTERM checkpoints step 3
    for suffix in (".safetensors", ".pt"):  # one training run, both formats: the real command once, then in this process
        output = tmp_path / f"model{suffix}"
        if suffix == ".safetensors":
            result = subprocess.run(
                [sys.executable, "-m", "netoptim", "export", "--to", str(output), *map(str, roots)], capture_output=True, text=True, timeout=60
            )
            assert result.returncode == 0, result.stderr
            assert f"exported step 3: {sum(p.numel() for p in named.values()):,} parameters from 2 node checkpoint(s)" in result.stdout
        else:
            assert console.main(["export", "--to", str(output), *map(str, roots)]) == 0
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(output)
        else:
            state = torch.load(output)
        fresh = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4))
        fresh.load_state_dict(state, strict=True)
        assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True))
    # Only one node's checkpoint: a clear error naming what is missing.
    with caplog.at_level("ERROR", logger="netoptim"):
        assert console.main(["export", "--to", str(output), str(roots[0])]) == 1
    assert "checkpoints of node(s) [1] are missing" in caplog.text


def test_an_unwritable_checkpoint_directory_does_not_stop_training(start_node, tmp_path):
    target = "/proc/netoptim-checkpoints"  # not writable, even for root
    node = start_node(extra_args=("--checkpoint-dir", target, "--checkpoint-every", "1"))
    params, errors = train(node.address, steps=2)
    assert not errors and params is not None
    log = node.log_text()
    assert "periodic checkpoint failed, training goes on: cannot write checkpoint of step 1 under /proc/netoptim-checkpoints" in log
