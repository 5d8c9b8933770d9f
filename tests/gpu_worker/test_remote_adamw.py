"""RemoteAdamW as a torch.optim.Optimizer, against a real node."""

from __future__ import annotations

import copy
import logging
import threading
import time

import pytest
import torch

from gpu_worker import RemoteAdamW
from gpu_worker.links import connections as node_connections
from gpu_worker.session import BYE_WAIT_S
from protos.job.placement import default_bucket_numel
from tests.gpu_worker.harness import run_threads
from tests.ports import restartable_address


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=generator)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_resume_learns_the_step_and_the_parameters(node):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = RemoteAdamW(model.named_parameters(), lr=0.1, nodes=[node.address], rank=0, world_size=1)
    assert opt.remote_step == 0
    train(model, opt, 3)
    assert opt.remote_step == 3
    trained = [p.detach().clone() for p in model.parameters()]
    state = opt.state_dict()
    assert state["netoptim"] == {"state_location": "optimizer_nodes", "nodes": [node.address], "step": 3, "world_size": 1}
    opt.close()

    torch.manual_seed(1)  # a restarted worker builds a differently initialized model...
    restarted = torch.nn.Linear(6, 3)
    opt = RemoteAdamW(restarted.named_parameters(), lr=0.1, nodes=[node.address], rank=0, world_size=1)
    assert opt.remote_step == 3  # ...and gets the nodes' step and values, not its own
    assert all(torch.equal(a, b) for a, b in zip(trained, restarted.parameters(), strict=True))
    opt.load_state_dict(state)
    train(restarted, opt, 1)
    assert opt.remote_step == 4
    opt.close()


def test_all_ranks_start_from_rank_0_values(node):
    models = [torch.nn.Linear(6, 3) for _ in range(2)]  # different initial values on purpose
    rank0_initial = [p.detach().clone() for p in models[0].parameters()]

    def worker(rank: int) -> None:
        RemoteAdamW(models[rank].parameters(), nodes=[node.address], rank=rank, world_size=2).close()

    run_threads(worker, 2)
    for model in models:
        assert all(torch.equal(a, b) for a, b in zip(rank0_initial, model.parameters(), strict=True))


def test_rank_and_world_size_from_torchrun_environment(node, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    opt = RemoteAdamW(torch.nn.Linear(2, 2).parameters(), nodes=[node.address])
    assert opt._session.rank == 0 and opt._session.job.world_size == 1
    opt.close()


def test_frozen_and_unused_parameters(node):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "unused": torch.nn.Linear(4, 4), "frozen": torch.nn.Linear(4, 4)})
    model["frozen"].requires_grad_(False)
    frozen_before = model["frozen"].weight.detach().clone()
    unused_before = model["unused"].weight.detach().clone()
    opt = RemoteAdamW(model.parameters(), lr=0.1, weight_decay=0.5, nodes=[node.address], rank=0, world_size=1, bucket_numel=64)
    assert len(opt._session.job.params) == 6  # frozen ones are registered too, so they can be unfrozen
    model["used"](torch.ones(1, 4)).sum().backward()
    opt.step()
    # As torch.optim.AdamW: a parameter whose grad is None is not stepped (no weight decay either).
    assert torch.equal(model["frozen"].weight, frozen_before)
    assert torch.equal(model["unused"].weight, unused_before)
    assert not torch.equal(model["used"].weight.detach(), frozen_before)
    opt.close()


def test_closure_and_bf16_parameters(node):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2).to(torch.bfloat16)
    opt = RemoteAdamW(model.parameters(), lr=0.05, nodes=[node.address], rank=0, world_size=1, wire_dtype=torch.bfloat16)
    x = torch.randn(16, 8).to(torch.bfloat16)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        return loss

    first = opt.step(closure).item()
    for _ in range(20):
        last = opt.step(closure).item()
    assert model.weight.dtype == torch.bfloat16 and last < first
    opt.close()


def test_constructor_rejects_bad_arguments():
    params = list(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="non-empty list of addresses"):
        RemoteAdamW(params, nodes=[])
    with pytest.raises(ValueError, match="non-empty list of addresses"):
        RemoteAdamW(params, nodes="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="learning rate"):
        RemoteAdamW(params, lr=-1.0, nodes=["tcp://127.0.0.1:1"])
    with pytest.raises(ValueError, match="beta2"):
        RemoteAdamW(params, betas=(0.9, 1.5), nodes=["tcp://127.0.0.1:1"])
    with pytest.raises(ValueError, match="amsgrad"):
        RemoteAdamW(params, amsgrad=True, nodes=["tcp://127.0.0.1:1"])
    with pytest.raises(TypeError, match="cannot travel"):
        RemoteAdamW(params, wire_dtype=torch.int8, nodes=["tcp://127.0.0.1:1"])
    with pytest.raises(ValueError, match="unsupported scheme"):
        RemoteAdamW(params, nodes=["http://127.0.0.1:1"], rank=0, world_size=1)
    with pytest.raises(ValueError, match="rank 2 is not in"):
        RemoteAdamW(params, nodes=["tcp://127.0.0.1:1"], rank=2, world_size=2)
    with pytest.raises(ValueError, match="max_grad_norm"):
        RemoteAdamW(params, nodes=["tcp://127.0.0.1:1"], rank=0, world_size=1, max_grad_norm=-1.0)


def test_unreachable_node_times_out_clearly():
    with pytest.raises(
        TimeoutError, match=r"node tcp://127.0.0.1:9 did not answer within 1 s while waiting for registration \(is a node running at that address"
    ) as timed_out:
        RemoteAdamW(torch.nn.Linear(2, 2).parameters(), nodes=["tcp://127.0.0.1:9"], rank=0, world_size=1, connect_timeout_s=1)
    assert "the connection: no connection: " in str(timed_out.value) and "nothing accepts connections at that address" in str(timed_out.value)


def test_a_worker_says_early_that_nothing_listens_at_a_nodes_address(caplog, monkeypatch):
    """The connection refused: a warning once the first seconds passed, not only the timeout's error."""
    monkeypatch.setattr(node_connections, "LINK_WARNING_S", 0.5)
    with caplog.at_level(logging.WARNING, logger="gpu_worker.links.connections"), pytest.raises(TimeoutError):
        RemoteAdamW(torch.nn.Linear(2, 2).parameters(), nodes=["tcp://127.0.0.1:9"], rank=0, world_size=1, connect_timeout_s=1.5)
    warned = [record.getMessage() for record in caplog.records if "no answer from node tcp://127.0.0.1:9 after" in record.getMessage()]
    assert len(warned) == 1 and "nothing accepts connections at that address" in warned[0] and "still trying for 1 s" in warned[0], warned


def accumulate_and_step(address: str, *, push_during_backward: bool) -> list[torch.Tensor]:
    """Two micro-batches per step, the first inside no_sync."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = RemoteAdamW(model.parameters(), lr=0.05, nodes=[address], rank=0, world_size=1, bucket_numel=64, push_during_backward=push_during_backward)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        with opt.no_sync():
            model(torch.randn(4, 6, generator=generator)).pow(2).mean().backward()
        if push_during_backward:
            assert opt._session.pushed == frozenset()  # nothing left inside no_sync
        model(torch.randn(4, 6, generator=generator)).pow(2).mean().backward()
        if push_during_backward:
            assert opt._session.pushed == frozenset(range(len(opt._session.buckets)))  # all went out during backward
        opt.step()
        opt.zero_grad()
    opt.close()
    return [p.detach().clone() for p in model.parameters()]


def test_push_during_backward_with_accumulation_is_bitwise_the_same(start_node):
    early = accumulate_and_step(start_node("early").address, push_during_backward=True)
    late = accumulate_and_step(start_node("late").address, push_during_backward=False)
    assert all(torch.equal(a, b) for a, b in zip(early, late, strict=True))


def _backward(model: torch.nn.Module, x: torch.Tensor, errors: list[BaseException]) -> None:
    try:
        model(x).pow(2).mean().backward()
    except BaseException as exc:
        errors.append(exc)


def test_gradients_final_on_another_thread_are_staged_there_and_sent_by_step(start_node):
    """Where autograd runs the hooks on a thread of its own (its device thread on a GPU; here a
    backward called from another thread), each bucket's gather starts there and the courier thread or
    step() sends it: bitwise torch's AdamW, and every bucket too large to batch went from its staged
    gather (test_push_courier.py waits for the courier to send them all)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 768), torch.nn.Tanh(), torch.nn.Linear(768, 4))
    reference = copy.deepcopy(model)
    node = start_node("staged")
    opt = RemoteAdamW(model.parameters(), lr=1e-2, nodes=[node.address], rank=0, world_size=1, bucket_numel=300_000, push_during_backward=True)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    sender = opt._session.pushes.sender
    large_ids = frozenset(bucket.bucket_id for bucket in opt._session.buckets if bucket.numel * 4 >= 1 << 20)
    large = len(large_ids)
    assert large >= 1 and large < len(opt._session.buckets)  # some are staged, the small last one is batched or sent as usual
    for step in range(4):
        x = torch.randn(8, 512, generator=torch.Generator().manual_seed(step))
        errors: list[BaseException] = []
        thread = threading.Thread(target=_backward, args=(model, x, errors))
        thread.start()
        thread.join()
        assert not errors, errors
        assert opt._session.pushed <= large_ids  # before step(): only staged buckets, from the courier thread
        opt.step()
        opt.zero_grad()
        reference(x).pow(2).mean().backward()
        torch_opt.step()
        torch_opt.zero_grad()
    assert sender.staged_pushes >= 4 * large and not sender._staged
    # the node is on this host: the staged gathers went straight into its window, none is left reserved
    assert opt.shared_memory_bytes["sent_in_place"] >= 4 * large * (1 << 20)
    (client,) = opt._session._connections._clients
    assert client.shared.connection.writer.reserved_bytes == 0
    opt.close()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))


def test_accumulating_outside_no_sync_is_an_error(node):
    model = torch.nn.Linear(4, 2)
    opt = RemoteAdamW(model.parameters(), nodes=[node.address], rank=0, world_size=1, push_during_backward=True)
    model(torch.ones(1, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"second gradient before step\(\).*no_sync"):
        model(torch.ones(1, 4)).sum().backward()
    opt.close()


def test_a_node_that_dies_mid_training_is_named(start_node):
    node = start_node(listen=restartable_address())  # no other test's node gets its port while this worker retries it
    model = torch.nn.Linear(4, 2)
    opt = RemoteAdamW(model.parameters(), nodes=[node.address], rank=0, world_size=1, timeout_s=2)
    node.process.kill()
    node.process.wait()
    model(torch.ones(1, 4)).sum().backward()
    with pytest.raises(TimeoutError, match=rf"node {node.address}: no answer \(is it running\?\)"):
        opt.step()
    opt.close()


def test_closing_after_the_node_stopped_does_not_wait_for_its_answer(node):
    """The node's link dropped: close() (or the collector, for an optimizer never closed) sends BYE
    and goes, where it used to wait out the answer that cannot come (5 s an optimizer, at a script's exit)."""
    model = torch.nn.Linear(4, 2)
    opt = RemoteAdamW(model.parameters(), nodes=[node.address], rank=0, world_size=1, timeout_s=60)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert node.stop() == 0
    started = time.monotonic()
    opt.close()
    assert time.monotonic() - started < BYE_WAIT_S - 1  # the BYE's linger (1 s) at most


def test_push_during_backward_with_frozen_and_later_unfrozen_layers(node):
    """Early pushes wait for every parameter that trains now: a frozen one gets no hook, and one
    unfrozen later (no hook either) holds its bucket back to step(); torch's AdamW is matched bitwise."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)
    reference = copy.deepcopy(model)
    opt = RemoteAdamW(model.parameters(), lr=1e-2, nodes=[node.address], rank=0, world_size=1, bucket_numel=64, push_during_backward=True)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    for step in range(5):
        if step == 2:
            model[0].requires_grad_(True)
            reference[0].requires_grad_(True)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (reference, torch_opt)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    opt.close()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))


def test_nodes_with_different_non_finite_policies_are_refused_at_registration(start_node):
    refusing, skipping = start_node("refusing"), start_node("skipping", extra_args=("--non-finite", "skip"))
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    with pytest.raises(RuntimeError, match=r"runs with --non-finite skip, node .* with --non-finite refuse: the nodes of a job must agree"):
        RemoteAdamW(model.parameters(), nodes=[refusing.address, skipping.address], rank=0, world_size=1, bucket_numel=4096)


def test_default_bucket_is_4m_elements_halved_until_each_node_has_16():
    assert default_bucket_numel(1_008_349_184, 1) == 1 << 22  # a 1.0B model on one node: 241 buckets
    assert default_bucket_numel(64 << 20, 1) == 1 << 22 and default_bucket_numel((64 << 20) - 1, 1) == 1 << 21
    assert default_bucket_numel(100_000_000, 4) == 1 << 20  # 4M would give the 4 nodes 6 buckets each
    assert default_bucket_numel(1000, 8) == 1 << 20  # never below 1M


def test_the_optimizer_takes_the_default_bucket_for_its_model_and_nodes(start_node):
    nodes = [start_node(f"n{i}").address for i in range(2)]
    model = torch.nn.Linear(2048, 2048)  # 4.2M parameters over 2 nodes: 1M-element buckets
    opt = RemoteAdamW(model.parameters(), nodes=nodes, rank=0, world_size=1)
    try:
        assert opt._session.job.bucket_numel == 1 << 20 and len(opt._session.buckets) == 5
    finally:
        opt.close()
