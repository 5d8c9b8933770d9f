"""One node, one job after another: a job is finished when every rank has closed its optimizer (BYE),
and the next job's rank 0 makes the node let it go (its checkpoints archived); `admin reset` lets a
job go on an operator's word. The next job trains exactly as on a fresh node."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import grpc
import pytest
import torch
from torch import nn

from gpu_worker import RemoteAdamW
from gpu_worker.links.connections import NodeError
from optimizer_node.config import NodeConfig
from optimizer_node.daemon import NodeDaemon
from protos import admin_pb2, admin_pb2_grpc
from protos.job.spec import JobSpec
from tests.gpu_worker.harness import run_threads

WORLD = 2
STEPS = 3


def model_a() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def model_b() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))


def train(address: str, make_model, steps: int = STEPS, close: bool = True) -> tuple[list[torch.Tensor], list[RemoteAdamW]]:
    """``WORLD`` worker threads train ``steps`` steps; rank 0's final parameters, and the optimizers (closed if ``close``)."""
    models = [make_model() for _ in range(WORLD)]
    optimizers: list[RemoteAdamW | None] = [None] * WORLD
    width = models[0][0].in_features

    def worker(rank: int) -> None:
        opt = RemoteAdamW(models[rank].parameters(), lr=0.05, nodes=[address], rank=rank, world_size=WORLD, bucket_numel=64, timeout_s=30)
        optimizers[rank] = opt
        for step in range(opt.remote_step, steps):
            generator = torch.Generator().manual_seed(step * WORLD + rank)
            models[rank](torch.randn(4, width, generator=generator)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        if close:
            opt.close()

    run_threads(worker, WORLD)
    return [p.detach().clone() for p in models[0].parameters()], optimizers  # type: ignore[return-value]


def status(stub) -> admin_pb2.GetStatusResponse:
    return stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=10)


def wait_for_state(stub, state: str, timeout_s: float = 10.0) -> admin_pb2.GetStatusResponse:
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        reply = status(stub)
        if reply.job_state == state or time.monotonic() > deadline:
            return reply
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fresh_b(tmp_path_factory) -> list[torch.Tensor]:
    from netoptim.launch.processes import NodeProcess

    with NodeProcess(tmp_path_factory.mktemp("fresh")) as node:
        params, _ = train(node.address, model_b)
    return params


@pytest.fixture
def admin_node(start_node, tmp_path):
    def start(*extra: str):
        node = start_node(extra_args=("--admin", "127.0.0.1:0", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1", *extra))
        channel = grpc.insecure_channel(node.admin_address)
        return node, admin_pb2_grpc.OptimizerNodeAdminStub(channel)

    return start


def test_a_node_serves_two_jobs_one_after_the_other(admin_node, tmp_path, fresh_b):
    node, stub = admin_node()
    train(node.address, model_a)
    finished = wait_for_state(stub, "finished")
    assert (finished.job_state, finished.step) == ("finished", STEPS)
    params, _ = train(node.address, model_b)  # another job: the node lets the finished one go and takes it
    assert all(torch.equal(a, b) for a, b in zip(params, fresh_b, strict=True))
    now = wait_for_state(stub, "finished")
    assert (now.step, now.jobs_let_go) == (STEPS, 1)
    archived = list((tmp_path / "ckpt" / "finished").iterdir())
    assert len(archived) == 1 and archived[0].name.endswith(f"-step-{STEPS:010d}")
    manifest = json.loads((archived[0] / f"step-{STEPS:010d}" / "manifest.json").read_text())
    assert list(JobSpec.from_wire(manifest["job"]).params[0].shape) == [16, 8]  # job A's state, resumable from there
    assert "let job" in node.log_text() and "finished at step 3" in node.log_text()


def test_the_same_job_again_resumes_where_it_finished(admin_node):
    node, stub = admin_node()
    train(node.address, model_a, steps=2)
    assert wait_for_state(stub, "finished").step == 2
    train(node.address, model_a, steps=STEPS)  # the job's own script, run longer: it goes on
    assert (status(stub).step, status(stub).jobs_let_go) == (STEPS, 0)


def test_admin_reset_lets_a_live_job_go_and_its_workers_stop_with_the_reason(admin_node, tmp_path, fresh_b):
    node, stub = admin_node()
    _, optimizers = train(node.address, model_a, steps=2, close=False)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Reset(admin_pb2.ResetRequest(confirm_node_id="another-node"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and status(stub).job_state == "training"
    reply = stub.Reset(admin_pb2.ResetRequest(confirm_node_id=status(stub).node_id), timeout=10)
    assert reply.step == 2 and reply.job and Path(reply.archived).parent == tmp_path / "ckpt" / "finished"
    assert (status(stub).job_state, status(stub).registered) == ("idle", False)
    opt = optimizers[0]
    opt.param_groups[0]["params"][0].grad = torch.zeros_like(opt.param_groups[0]["params"][0])
    with pytest.raises(RuntimeError, match="let this job go: an operator reset the node"):
        opt.step()
    for optimizer in optimizers:
        optimizer.close()
    params, _ = train(node.address, model_b)
    assert all(torch.equal(a, b) for a, b in zip(params, fresh_b, strict=True))


def test_with_next_job_refuse_a_finished_job_stays_until_reset(admin_node, fresh_b):
    node, stub = admin_node("--next-job", "refuse")
    train(node.address, model_a)
    wait_for_state(stub, "finished")
    with pytest.raises(NodeError, match=r"LAYOUT_MISMATCH.*admin reset"):
        RemoteAdamW(model_b().parameters(), lr=0.05, nodes=[node.address], rank=0, world_size=WORLD, bucket_numel=64, timeout_s=30)
    stub.Reset(admin_pb2.ResetRequest(confirm_node_id=status(stub).node_id), timeout=10)
    params, _ = train(node.address, model_b)
    assert all(torch.equal(a, b) for a, b in zip(params, fresh_b, strict=True))


def _state_of(value: object, depth: int = 0, node_wide: frozenset[int] = frozenset()) -> object:
    """A comparable picture of a daemon attribute: plain values as they are, objects by their fields;
    the node-wide objects a job's part refers to (``node_wide``: their ids, the node's own; its id, a
    string, too) by their type."""
    if isinstance(value, str) and id(value) in node_wide:
        return str
    if isinstance(value, (type(None), bool, int, float, str, bytes)):
        return value
    if id(value) in node_wide:
        return type(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value), [_state_of(v, depth + 1, node_wide) for v in value]
    if isinstance(value, dict):
        return {k: _state_of(v, depth + 1, node_wide) for k, v in value.items()}
    if isinstance(value, torch.Tensor) or depth >= 2 or callable(value):
        return type(value)
    fields = getattr(value, "__dict__", None)
    if fields is None and hasattr(value, "__slots__"):
        fields = {name: getattr(value, name) for name in value.__slots__ if hasattr(value, name)}
    return type(value), {k: _state_of(v, depth + 1, node_wide) for k, v in (fields or {}).items()}


NODE_WIDE = {
    # the endpoint, identity and what serves the operator: the node's, not a job's
    "config", "_transport", "_endpoint", "address", "same_host_address", "node_id", "_handlers", "commands", "clock",
    "admin_address", "metrics_address", "non_finite", "metrics", "started_at", "_crash_points", "limit_log", "_stop",
    # bounded budgets for peers outside any job; the registrar, with the HELLOs waiting for a rank 0
    # (of this job or the next) and the keys allowed each rank
    "_echoes_in_flight", "_outgoing", "_registrar",
    # the update passes' thread (--pass-thread), and whether it wakes the endpoint
    "_passes", "_woken_by_passes",
    # what every job is given of the node (NodeParts)
    "_node_parts",
    "jobs_let_go",
}  # fmt: skip


def node_wide_ids(node: NodeDaemon) -> frozenset[int]:
    return frozenset([id(node), *(id(value) for name, value in vars(node).items() if name in NODE_WIDE)])


def test_a_node_that_let_its_job_go_is_a_fresh_node_in_every_job_field():
    """Every attribute of the daemon that is not node-wide is as a new node has it, once a job that
    trained (with an override, a pause and resume, a finished step) is let go: a field added for a job
    and not reset fails here."""
    fresh = NodeDaemon(NodeConfig(same_host_ipc=False))
    fresh.close()
    node = NodeDaemon(NodeConfig(same_host_ipc=False))
    stop = threading.Event()
    serving = threading.Thread(target=node.serve, args=(stop,))
    serving.start()
    try:
        node.commands.call(lambda: node.operator.set_overrides(type(node.operator.hyper_overrides)(lr_scale=0.5)))
        train(node.address, model_a)
        node.commands.call(lambda: node.operator.pause("checking"))
        assert node.commands.call(lambda: node.let_job_go("a test"))["step"] == STEPS
        after = {name: _state_of(value, node_wide=node_wide_ids(node)) for name, value in vars(node).items() if name not in NODE_WIDE}
        before = {name: _state_of(value, node_wide=node_wide_ids(fresh)) for name, value in vars(fresh).items() if name not in NODE_WIDE}
        assert after.keys() == before.keys()
        for name in before:
            assert after[name] == before[name], name
    finally:
        stop.set()
        serving.join(30)
