"""Elastic jobs: the membership agreement (gpu_worker.elastic) and a job that shrinks and grows
against a real node, bitwise equal to torch's AdamW fed each step's average at that step's width."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gpu_worker.elastic import ElasticGroup, shard
from netoptim.benchmarks.morph_bench import measure


def test_a_job_that_shrinks_and_grows_is_bitwise_equal_to_torch_at_the_same_widths(tmp_path):
    result = measure(steps=11, leave_after=2, join_after=6, model_width=16, workdir=tmp_path)
    assert result["max_abs_diff"] == 0.0
    widths = dict(result["widths"])
    assert widths[0] == 4 and min(widths.values()) == 2 and list(widths.values())[-1] == 3


def test_shard_is_a_function_of_step_and_global_index():
    assert list(shard(2, 12, 1, 3)) == [28, 29, 30, 31]
    assert sorted(i for rank in range(4) for i in shard(5, 12, rank, 4)) == list(range(60, 72))
    with pytest.raises(ValueError, match="does not split over 5 workers"):
        shard(0, 12, 0, 5)


def test_members_agree_on_one_step_whoever_sees_the_change_first():
    """Two members a step apart when a third asks to leave: both change at the same step."""
    store = torch.distributed.HashStore()
    ElasticGroup.create(store, ["a", "b", "c"])
    groups = {name: ElasticGroup(store, name, timeout_s=10) for name in "abc"}
    for group in groups.values():
        group.start()
    groups["c"].request_leave()
    assert groups["c"].at_boundary(4) is None  # proposes, acknowledges with 5, trains step 4
    assert groups["a"].at_boundary(4) is None  # acknowledges with 5
    changes: dict[str, object] = {}
    late = threading.Thread(target=lambda: changes.setdefault("b", groups["b"].at_boundary(5)))  # b sees it only at 5: acknowledges 6
    late.start()
    late.join(10)
    changes["a"] = groups["a"].at_boundary(5)
    changes["c"] = groups["c"].at_boundary(5)
    assert changes == {"a": None, "b": None, "c": None}  # the largest acknowledgement, 6, wins
    assert groups["a"].at_boundary(6).rank == 0 and groups["b"].at_boundary(6).world_size == 2
    assert groups["c"].at_boundary(6).leaving


def test_a_member_that_never_acknowledges_is_named():
    """A member dead without notice never acknowledges a change: the others stop, naming it."""
    store = torch.distributed.HashStore()
    ElasticGroup.create(store, ["a", "b"])
    a = ElasticGroup(store, "a", timeout_s=0.5)
    a.start()
    ElasticGroup(store, "b").start()  # and then it dies
    joiner = ElasticGroup(store, "c", timeout_s=0.5)
    failures: list[BaseException] = []

    def join() -> None:
        try:
            joiner.join()
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=join)
    thread.start()
    deadline = time.monotonic() + 10
    while store.get("netoptim/elastic/version") == b"0" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert a.at_boundary(7) is None  # acknowledges with 8
    with pytest.raises(RuntimeError, match=r"member\(s\) \['b'\] did not acknowledge membership change 1"):
        a.at_boundary(8)
    thread.join(10)
    assert failures  # the joiner waited for an agreement that never came


def test_an_operator_asks_a_rank_to_leave_and_the_job_goes_on_narrower(start_node):
    import grpc

    from gpu_worker import RemoteAdamW
    from netoptim.benchmarks.morph_bench import GLOBAL_BATCH, LR, WEIGHT_DECAY, loss_of, make_model, reference, samples
    from protos import admin_pb2, admin_pb2_grpc

    node = start_node(extra_args=("--admin", "127.0.0.1:0"))
    stub = admin_pb2_grpc.OptimizerNodeAdminStub(grpc.insecure_channel(node.admin_address))
    store = torch.distributed.HashStore()
    ElasticGroup.create(store, ["a", "b", "c"])
    steps, widths, finals, errors = 8, {}, {}, []
    reached = threading.Event()
    asked = threading.Event()  # the members wait for the operator's request after step 2: else, on a busy machine, all 8 steps were done first

    def member(name: str) -> None:
        try:
            group = ElasticGroup(store, name, timeout_s=30)
            first = group.start()
            model = make_model(16)
            opt = RemoteAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, nodes=[node.address], rank=first.rank, world_size=first.world_size)
            group.follow(opt)
            step = 0
            while step < steps:
                change = group.at_boundary(step)
                if change is not None and change.leaving:
                    break
                if change is not None:
                    opt.morph(change.rank, change.world_size, change.at_step)
                loss_of(model, *samples(shard(step, GLOBAL_BATCH, opt.rank, opt.world_size))).backward()
                opt.step()
                opt.zero_grad()
                widths[step] = opt.world_size
                step += 1
                if step == 2:
                    reached.set()
                    assert asked.wait(30), "the operator's request was not made"
            finals[name] = (step, [p.detach().clone() for p in model.parameters()])
            opt.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(name,), daemon=True) for name in "abc"]
    for thread in threads:
        thread.start()
    assert reached.wait(30)
    try:
        reply = stub.Morph(admin_pb2.MorphRequest(leave=[2], reason="spot reclaim"), timeout=10)
    finally:
        asked.set()
    assert list(reply.told) == [2] and reply.world_size == 3
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert finals["c"][0] < steps and finals["a"][0] == steps and widths[0] == 3 and widths[steps - 1] == 2
    assert all(torch.equal(x, y) for x, y in zip(finals["a"][1], reference(widths, steps, 16), strict=True))
    status = stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
    assert (status.world_size, status.morphs, status.last_morph_from) == (2, 1, 3)
