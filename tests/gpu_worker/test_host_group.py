"""Host groups: G workers of a host sum their gradients in shared memory and one of them talks to the
nodes. Bitwise against torch's AdamW fed the host sums added in host order over H x G; the node
receives one gradient per host (G times fewer bytes than with every worker pushing)."""

from __future__ import annotations

import threading
import urllib.request
import uuid

import pytest
import torch

from gpu_worker import RemoteAdamW
from gpu_worker.hierarchical import HostGroupAdamW
from gpu_worker.host_group import HostGroup
from tests.gpu_worker.harness import loss_fn, make_model, run_threads

HOSTS, LOCAL, STEPS, BATCH = 2, 2, 4, 8


def shard(step: int, worker: int, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(BATCH, 8, generator=generator), torch.randn(BATCH, 4, generator=generator)
    per = BATCH // workers
    return x[worker * per : (worker + 1) * per], y[worker * per : (worker + 1) * per]


def received_bytes(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith("netoptim_bytes_received_total "))


def reference() -> list[torch.Tensor]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(STEPS):
        host_sums = []
        for host in range(HOSTS):
            total = None
            for local in range(LOCAL):
                replica = make_model()
                replica.load_state_dict(model.state_dict())
                loss_fn(replica, *shard(step, host * LOCAL + local, HOSTS * LOCAL)).backward()
                grads = [p.grad for p in replica.parameters()]
                total = [g.clone() for g in grads] if total is None else [t.add_(g) for t, g in zip(total, grads, strict=True)]
            host_sums.append(total)
        for index, param in enumerate(model.parameters()):
            grad = host_sums[0][index].clone()
            for host in range(1, HOSTS):
                grad += host_sums[host][index]
            param.grad = grad / (HOSTS * LOCAL)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("push_during_backward", "pace_window_bytes"), [(False, None), (True, None), (True, 64)], ids=["at-step", "during-backward", "during-backward-paced"]
)
def test_host_groups_sum_locally_push_once_per_host_and_match_torch(start_node, push_during_backward, pace_window_bytes):
    node = start_node(extra_args=("--metrics-port", "0"))
    name = uuid.uuid4().hex[:8]
    models = [make_model() for _ in range(HOSTS * LOCAL)]
    results: dict[int, list[torch.Tensor]] = {}
    start = threading.Barrier(HOSTS * LOCAL)

    def worker(index: int) -> None:
        host, local = divmod(index, LOCAL)
        opt = HostGroupAdamW(
            models[index].parameters(), lr=1e-2, weight_decay=0.1, host_group=HostGroup(f"{name}-{host}", local, LOCAL), rank=host, world_size=HOSTS,
            nodes=[node.address], timeout_s=30, push_during_backward=push_during_backward,
            **({"pace_window_bytes": pace_window_bytes, "bucket_numel": 64} if pace_window_bytes else {}),
        )  # fmt: skip
        start.wait()
        for step in range(opt.remote_step, STEPS):
            loss_fn(models[index], *shard(step, index, HOSTS * LOCAL)).backward()
            opt.step()
            opt.zero_grad()
        results[index] = [p.detach().clone() for p in models[index].parameters()]
        if opt._remote is not None and opt._remote._session.pacer is not None:
            paced_waits[index] = opt._remote._session.pacer.waits
        opt.close()

    paced_waits: dict[int, int] = {}
    run_threads(worker, HOSTS * LOCAL)
    if pace_window_bytes:
        assert sorted(paced_waits) == [0, LOCAL] and sum(paced_waits.values()) > 0, paced_waits  # the leaders' pushes waited for room
    expected = reference()
    for index in range(HOSTS * LOCAL):  # every worker of every host holds the same parameters
        assert all(torch.equal(a, b) for a, b in zip(results[index], expected, strict=True)), index
    numel = sum(p.numel() for p in make_model().parameters())
    assert received_bytes(node.metrics_url) == 4 * numel * (1 + HOSTS * STEPS)  # initial values + one gradient per host and step


def test_without_host_groups_the_node_receives_every_workers_gradient(start_node):
    """The baseline of the byte count above: G times the gradient bytes."""
    node = start_node(extra_args=("--metrics-port", "0"))
    models = [make_model() for _ in range(HOSTS * LOCAL)]

    def worker(index: int) -> None:
        opt = RemoteAdamW(models[index].parameters(), lr=1e-2, weight_decay=0.1, nodes=[node.address], rank=index, world_size=HOSTS * LOCAL, timeout_s=30)
        for step in range(STEPS):
            loss_fn(models[index], *shard(step, index, HOSTS * LOCAL)).backward()
            opt.step()
            opt.zero_grad()
        opt.close()

    run_threads(worker, HOSTS * LOCAL)
    numel = sum(p.numel() for p in make_model().parameters())
    assert received_bytes(node.metrics_url) == 4 * numel * (1 + HOSTS * LOCAL * STEPS)


def test_a_member_that_does_not_arrive_is_named():
    with pytest.raises(TimeoutError, match="waited 0 s for the leader of host group"):
        HostGroupAdamW(
            make_model().parameters(),
            host_group=HostGroup(f"absent-{uuid.uuid4().hex[:8]}", 1, 2),
            rank=0,
            world_size=1,
            nodes=["tcp://127.0.0.1:9"],
            timeout_s=0.2,
        )


def test_a_second_backward_before_step_is_refused_when_pushing_during_backward(start_node):
    """One backward per step: a second one would add the followers' gradients twice."""
    node = start_node()
    name = uuid.uuid4().hex[:8]
    models = [make_model() for _ in range(LOCAL)]
    errors: dict[int, str] = {}

    def worker(local: int) -> None:
        opt = HostGroupAdamW(
            models[local].parameters(), host_group=HostGroup(name, local, LOCAL), rank=0, world_size=1, nodes=[node.address], timeout_s=5,
            push_during_backward=True,
        )  # fmt: skip
        try:
            for _ in range(2):
                loss_fn(models[local], *shard(0, local, LOCAL)).backward()
        except RuntimeError as error:
            errors[local] = str(error)
        finally:
            opt.close()

    run_threads(worker, LOCAL)
    assert sorted(errors) == [0, 1]
    assert all("second gradient before step()" in error and "push_during_backward=False" in error for error in errors.values())


def test_members_that_exchange_otherwise_are_refused():
    """A follower built with push_during_backward against a leader without it would wait for pieces that never come."""
    from gpu_worker.host_group import HostExchange

    name = f"mixed-{uuid.uuid4().hex[:8]}"
    leader = HostExchange(HostGroup(name, 0, 2), 10, 1.0)
    try:
        with pytest.raises(ValueError, match="the same push_during_backward"):
            HostExchange(HostGroup(name, 1, 2), 10, 1.0, pieces=3)
    finally:
        leader.close()


def test_overlap_forward_is_refused_in_a_host_group():
    """The leader hands the new parameters over once the step is over: nothing a forward could overlap."""
    model = make_model()
    with pytest.raises(ValueError, match="overlap_forward is for RemoteAdamW alone"):
        HostGroupAdamW(
            model.parameters(), host_group=HostGroup(f"overlap-{uuid.uuid4().hex[:8]}", 0, 2), rank=0, world_size=2, overlap_forward=True, module=model
        )
