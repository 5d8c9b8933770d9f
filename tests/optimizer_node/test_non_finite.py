"""Gradients with NaN or inf against real nodes: refused by default with an error that names the rank
and bucket (the node's state stays finite and unchanged, the step can be finished by pushing again),
or, with ``--non-finite skip``, the whole step skipped on every node as GradScaler skips
``optimizer.step()``, bitwise like torch's AdamW that skipped the same step."""

from __future__ import annotations

import argparse
import copy
import math
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from gpu_worker import NonFiniteGradientError, RemoteAdamW
from netoptim.cli.node_configs import node_config_from_args
from netoptim.cli.node_parser import add_node_parser
from optimizer_node.config import NodeConfig
from optimizer_node.intake.non_finite import count_non_finite
from optimizer_node.state.checkpoint import read_latest
from optimizer_node.update.kernels import compiled_update
from protos import admin_pb2, admin_pb2_grpc
from tests.gpu_worker.harness import loss_fn, make_model, max_difference, param_groups, reference_averaged, run_threads, schedule, shard
from tests.optimizer_node.raw_client import JOB, Mirror, RawWorker
from transport.batches import BATCH_BYTES
from transport.wire import ErrorCode, MsgType, tensor_header
from transport.zeromq.backend import ZmqTransport

STEPS = 6
BAD_STEP = 3  # the step at which rank 1's gradient holds a NaN


def status_of(node) -> admin_pb2.GetStatusResponse:
    with grpc.insecure_channel(node.admin_address) as channel:
        return admin_pb2_grpc.OptimizerNodeAdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)


def metrics_of(node) -> dict[str, float]:
    with urllib.request.urlopen(node.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in text.splitlines() if line.startswith("netoptim_non_finite"))}


# ---------------------------------------------------------------- the check itself


def test_count_non_finite_is_exact_and_accepts_sums_that_overflow():
    clean = torch.randn(1000)
    assert count_non_finite([(0, clean)]) == 0
    dirty = clean.clone()
    dirty[[3, 500, 999]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    assert count_non_finite([(0, clean[:500]), (500, dirty[500:])]) == 2
    huge = torch.full((8,), 3e38)  # every element finite, the sum is not: torch would apply it
    assert not math.isfinite(float(huge.sum())) and count_non_finite([(0, huge)]) == 0
    for dtype in (torch.bfloat16, torch.float16):
        assert count_non_finite([(0, torch.full((100_000,), 60_000.0).to(dtype))]) == 0  # fp16's own sum would overflow
        assert count_non_finite([(0, dirty.to(dtype))]) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_compiled_count_agrees_with_torch_serial_and_over_threads(dtype):
    if not (compiled_update.usable() and compiled_update.ready()):  # as after a node's first update
        pytest.skip("the compiled loop is off here (NETOPTIM_COMPILED_UPDATE=0)")
    generator = torch.Generator().manual_seed(1)
    for numel in (1, compiled_update.CHECK_CHUNK, 3 * compiled_update.CHECK_CHUNK + 7):  # counted in this thread, then over chunks
        view = (torch.randn(numel, generator=generator) * 1e4).to(dtype)
        assert compiled_update.count_non_finite(view) == 0
        where = torch.randint(0, numel, (5,), generator=generator)
        view[where] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan"), float("inf")], dtype=dtype)
        expected = int(numel - torch.isfinite(view).sum())
        assert compiled_update.count_non_finite(view) == expected == count_non_finite([(0, view)])
    assert compiled_update.count_non_finite(torch.zeros(10, dtype=torch.float64)) is None  # torch counts what the loop does not take
    assert compiled_update.count_non_finite(torch.zeros(10)[::2]) is None


def test_policy_flag():
    with pytest.raises(ValueError, match="refuse' or 'skip"):
        NodeConfig(non_finite="ignore").validate()
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    add_node_parser(subparsers)
    help_text = " ".join(subparsers.choices["node"].format_help().split())
    assert "--non-finite {refuse,skip}" in help_text and "GradScaler" in help_text and "(default: refuse)" in help_text
    assert node_config_from_args(parser.parse_args(["node"])).non_finite == "refuse"
    assert node_config_from_args(parser.parse_args(["node", "--non-finite", "skip"])).non_finite == "skip"
    assert "--non-finite-check {worker,node}" in help_text and "(default: worker)" in help_text
    assert node_config_from_args(parser.parse_args(["node", "--non-finite-check", "node"])).non_finite_check == "node"
    with pytest.raises(ValueError, match="'worker' or 'node'"):
        NodeConfig(non_finite_check="device").validate()


# ---------------------------------------------------------------- refuse (the default), message by message


@pytest.fixture
def raw_job(start_node):
    """A node (default policy) with a registered 2-rank job whose two buckets hold initial values."""
    node = start_node(extra_args=("--admin", "127.0.0.1:0", "--metrics-port", "0"))
    transport = ZmqTransport()
    rank0, rank1 = RawWorker(transport, node.address, 0), RawWorker(transport, node.address, 1)
    assert rank0.hello().meta["non_finite"] == "refuse"
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(b.numel, generator=generator) for b in JOB.plan()]
    for bucket_id, values in enumerate(initial):
        assert rank0.request(tensor_header(MsgType.INIT, values, rank=0, bucket_id=bucket_id), values).msg_type == MsgType.ACK
    rank1.hello()
    yield node, rank0, rank1, Mirror(initial), generator
    for worker in (rank0, rank1):
        worker.client.close()
    transport.close()


def test_non_finite_push_is_refused_and_the_step_can_be_finished(raw_job):
    node, rank0, rank1, mirror, generator = raw_job
    numel = mirror.buckets[1].numel
    good0, good1 = torch.randn(numel, generator=generator), torch.randn(numel, generator=generator)
    rank0.push(1, 0, good0)  # rank 0's gradient is in before rank 1's poisoned ones
    for bad in (float("nan"), float("inf"), -float("inf")):
        poisoned = good1.clone()
        poisoned[[0, 7, numel - 1]] = bad
        rank1.push(1, 0, poisoned)
        error = rank1.reply()
        assert error.msg_type == MsgType.ERROR and error.meta["code"] == ErrorCode.NON_FINITE
        assert (error.bucket_id, error.step, error.meta["rank"], error.meta["values"]) == (1, 0, 1, 3)
        for words in ("rank 1", "bucket 1", "step 0", "3 NaN/inf", "--non-finite skip", "learning rate"):
            assert words in error.meta["message"]
        notice = rank0.reply()  # the other rank, which waits for this bucket, is told why
        assert notice.msg_type == MsgType.NOTICE and notice.meta["non_finite"] == {"rank": 1, "bucket": 1, "step": 0, "values": 3}
        # The node's parameters are as they were, and finite.
        for bucket_id, expected in enumerate(mirror.param):
            values = rank1.pull(bucket_id)
            assert torch.equal(values, expected) and bool(torch.isfinite(values).all())
    # A finite push for the same bucket and step finishes the step with rank 0's gradient, which the node kept.
    rank1.push(1, 0, good1)
    mirror.apply(1, [good0, good1])
    for worker in (rank0, rank1):
        header, values = worker.reply()
        assert header.msg_type == MsgType.PARAMS and header.step == 1
        assert torch.equal(values, mirror.param[1])
    # Bucket 0 was never held up: a normal step of it still works.
    grads = [torch.randn(mirror.buckets[0].numel, generator=generator) for _ in range(2)]
    rank0.push(0, 0, grads[0])
    rank1.push(0, 0, grads[1])
    mirror.apply(0, grads)
    assert all(torch.equal(worker.reply()[1], mirror.param[0]) for worker in (rank0, rank1))
    status = status_of(node).non_finite
    assert (status.policy, status.refused_pushes, status.skipped_steps) == ("refuse", 3, 0)
    assert (status.last.action, status.last.rank, status.last.bucket, status.last.step, status.last.values) == ("refused", 1, 1, 0, 3)
    metrics = metrics_of(node)
    assert metrics["netoptim_non_finite_refused_total"] == 3 and metrics["netoptim_non_finite_skipped_steps_total"] == 0
    assert (metrics["netoptim_non_finite_last_rank"], metrics["netoptim_non_finite_last_bucket"], metrics["netoptim_non_finite_last_step"]) == (1, 1, 0)
    assert metrics['netoptim_non_finite_policy{policy="refuse"}'] == 1


def test_finite_gradient_whose_sum_overflows_is_accepted(raw_job):
    _node, rank0, rank1, mirror, generator = raw_job
    numel = mirror.buckets[0].numel
    huge = torch.zeros(numel)
    huge[:4] = 3e38  # its sum is inf, every element is finite
    other = torch.randn(numel, generator=generator)
    rank0.push(0, 0, huge)
    rank1.push(0, 0, other)
    mirror.apply(0, [huge, other])
    header, values = rank0.reply()
    assert header.msg_type == MsgType.PARAMS and torch.equal(values, mirror.param[0])


@pytest.mark.parametrize("check", ["worker", "node"])
def test_a_workers_word_spares_the_nodes_check_unless_the_node_checks_everything(start_node, check):
    """``--non-finite-check worker`` (the default) takes a push's ``finite`` word without reading the
    gradient (a NaN vouched for gets in: the word guards against accidents, a GPU worker gives it only
    for a finite sum); ``node`` checks every push, vouched or not."""
    node = start_node(extra_args=("--metrics-port", "0", "--non-finite-check", check))
    transport = ZmqTransport()
    rank0, rank1 = RawWorker(transport, node.address, 0), RawWorker(transport, node.address, 1)
    try:
        rank0.hello()
        generator = torch.Generator().manual_seed(0)
        initial = [torch.randn(b.numel, generator=generator) for b in JOB.plan()]
        for bucket_id, values in enumerate(initial):
            assert rank0.request(tensor_header(MsgType.INIT, values, rank=0, bucket_id=bucket_id), values).msg_type == MsgType.ACK
        rank1.hello()
        mirror = Mirror(initial)
        numel = mirror.buckets[0].numel
        grads = [torch.randn(numel, generator=generator) for _ in range(2)]
        rank0.push(0, 0, grads[0], finite=True)
        rank1.push(0, 0, grads[1], finite=True)
        mirror.apply(0, grads)
        assert all(torch.equal(worker.reply()[1], mirror.param[0]) for worker in (rank0, rank1))
        poisoned = torch.randn(mirror.buckets[1].numel, generator=generator)
        poisoned[0] = float("nan")
        rank1.push(1, 0, poisoned, finite=True)
        if check == "node":
            error = rank1.reply()
            assert error.msg_type == MsgType.ERROR and error.meta["code"] == ErrorCode.NON_FINITE
        else:  # taken on its word: the step completes, with a NaN in the new values
            rank0.push(1, 0, torch.randn(mirror.buckets[1].numel, generator=generator))
            header, values = rank1.reply()
            assert header.msg_type == MsgType.PARAMS and bool(values.isnan().any())
        metrics = metrics_of(node)
        assert metrics["netoptim_non_finite_vouched_pushes_total"] == (3 if check == "worker" else 0)
        assert metrics["netoptim_non_finite_refused_total"] == (0 if check == "worker" else 1)
    finally:
        for worker in (rank0, rank1):
            worker.client.close()
        transport.close()


def test_a_cpu_worker_vouches_for_the_buckets_it_sums_finite_and_a_nan_is_still_refused(start_node):
    """A CPU worker sums each lone bucket as it gathers it: a finite sum goes with the word and the node
    reads nothing more; a NaN makes no word, and the node finds it and refuses the push."""
    node = start_node(extra_args=("--metrics-port", "0"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 4))
    reference = copy.deepcopy(model)
    opt = RemoteAdamW(model.parameters(), lr=1e-2, nodes=[node.address], rank=0, world_size=1, bucket_numel=1 << 18, timeout_s=60)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    # two halves of the first weight, and the rest in a third bucket, small but alone (a batch of one): each push a lone bucket
    assert [bucket.numel * 4 >= BATCH_BYTES for bucket in opt._session.buckets] == [True, True, False]
    sender = opt._session.pushes.sender
    for step in range(3):
        x = torch.randn(8, 512, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        if step == 1:
            kept = model[0].weight.grad.clone()
            model[0].weight.grad[5, 5] = float("nan")
            with pytest.raises(NonFiniteGradientError):
                opt.step()
            model[0].weight.grad.copy_(kept)
        opt.step()
        opt.zero_grad()
        reference(x).pow(2).mean().backward()
        torch_opt.step()
        torch_opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    # each step's buckets once with the word: the poisoned push went without, its retry with it
    assert sender.vouched_pushes == 3 * 3
    metrics = metrics_of(node)
    assert metrics["netoptim_non_finite_vouched_pushes_total"] == sender.vouched_pushes and metrics["netoptim_non_finite_refused_total"] == 1
    opt.close()


# ---------------------------------------------------------------- refuse, through RemoteAdamW


def train(nodes: list[str], *, retry: bool, poison_rank: int = 1, steps: int = STEPS, max_grad_norm: float | None = None) -> dict[int, dict]:
    """Two worker threads; at BAD_STEP, ``poison_rank`` puts a NaN into its gradient. With ``retry``
    its step() must raise NonFiniteGradientError; it then restores the gradient and calls step() again.
    Returns rank 0's final parameters and what each rank observed."""
    models = [make_model() for _ in range(2)]
    seen: dict[int, dict] = {0: {"skipped": []}, 1: {"skipped": []}}
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            model = models[rank]
            opt = RemoteAdamW(
                param_groups(model, named=True),
                lr=1e-2,
                weight_decay=0.1,
                nodes=nodes,
                rank=rank,
                world_size=2,
                bucket_numel=300,
                timeout_s=60,
                max_grad_norm=max_grad_norm,
            )
            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
            for step in range(steps):
                loss_fn(model, *shard(step, rank, 2)).backward()
                if step == BAD_STEP and rank == poison_rank:
                    weight = model[2].weight.grad
                    kept = float(weight[1, 2])
                    weight[1, 2] = float("nan")
                    if retry:
                        with pytest.raises(NonFiniteGradientError) as info:
                            opt.step()
                        seen[rank]["error"] = info.value
                        seen[rank]["before_retry"] = {n: p.detach().clone() for n, p in model.named_parameters()}
                        weight[1, 2] = kept  # the true gradient again: the step finishes as if nothing happened
                opt.step()
                seen[rank]["skipped"].append(opt.last_step_skipped)
                opt.zero_grad()
                scheduler.step()
            seen[rank]["params"] = [p.detach().clone() for p in model.parameters()]
            seen[rank]["skipped_steps"] = opt.skipped_steps
            opt.close()
        except BaseException as exc:
            errors.append(exc)

    run_threads(worker, 2, timeout_s=90)
    if errors:
        raise errors[0]
    assert all(torch.equal(a, b) for a, b in zip(seen[0]["params"], seen[1]["params"], strict=True))
    return seen


def test_remote_adamw_raises_naming_rank_and_bucket_and_a_retry_finishes_the_step(start_node):
    node = start_node(extra_args=("--admin", "127.0.0.1:0"))
    seen = train([node.address], retry=True)
    error: NonFiniteGradientError = seen[1]["error"]
    assert error.code == ErrorCode.NON_FINITE and error.rank == 1 and error.step == BAD_STEP
    assert [(bucket_id, step, values) for _node, bucket_id, step, values in error.refusals] == [(error.refusals[0][1], BAD_STEP, 1)]
    message = str(error)
    for words in ("rank 1", f"step {BAD_STEP}", f"bucket {error.refusals[0][1]}", "2.weight", "NaN/inf", "learning rate", "GradScaler", "--non-finite skip"):
        assert words in message, message
    assert all(bool(torch.isfinite(p).all()) for p in seen[1]["before_retry"].values())
    # The retry pushed the true gradient: the run is the run without the NaN, bitwise.
    reference, _ = reference_averaged(2, fused=True, steps=STEPS)
    assert max_difference(seen[0]["params"], reference) == 0.0
    assert status_of(node).non_finite.refused_pushes == 1


# ---------------------------------------------------------------- skip: GradScaler semantics


def reference_skipping(skip_step: int, steps: int = STEPS, max_grad_norm: float | None = None) -> list[torch.Tensor]:
    """torch's fused AdamW fed the rank-ordered average of the two shards' gradients, whose
    optimizer.step() is not called at ``skip_step`` (as GradScaler does); the scheduler steps anyway."""
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2, weight_decay=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    params = list(model.parameters())
    for step in range(steps):
        grads = []
        for rank in range(2):
            replica = copy.deepcopy(model)
            loss_fn(replica, *shard(step, rank, 2)).backward()
            grads.append([p.grad for p in replica.parameters()])
        for index, param in enumerate(params):
            param.grad = (grads[0][index] + grads[1][index]) / 2
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        if step != skip_step:
            opt.step()
        opt.zero_grad()
        scheduler.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("max_grad_norm", [None, 0.05], ids=["no-clip", "clip"])
def test_skip_policy_skips_the_step_on_every_node_like_grad_scaler(start_node, tmp_path, max_grad_norm):
    checkpoints = tmp_path / "ckpt"
    nodes = [
        start_node("skip0", extra_args=("--non-finite", "skip", "--admin", "127.0.0.1:0", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1")),
        start_node("skip1", extra_args=("--non-finite", "skip", "--admin", "127.0.0.1:0", "--metrics-port", "0")),
    ]
    seen = train([n.address for n in nodes], retry=False, max_grad_norm=max_grad_norm)
    expected_skips = [step == BAD_STEP for step in range(STEPS)]
    assert seen[0]["skipped"] == expected_skips and seen[1]["skipped"] == expected_skips
    assert seen[0]["skipped_steps"] == seen[1]["skipped_steps"] == 1
    reference = reference_skipping(BAD_STEP, max_grad_norm=max_grad_norm)
    difference = max_difference(seen[0]["params"], reference)
    # Clipping: the global norm is summed in another order than torch's (last-bit differences).
    assert difference == 0.0 if max_grad_norm is None else difference <= 1e-6
    assert all(bool(torch.isfinite(p).all()) for p in seen[0]["params"])
    statuses = [status_of(n) for n in nodes]
    assert all(s.step == STEPS and s.non_finite.policy == "skip" and s.non_finite.skipped_steps == 1 for s in statuses)
    assert all(s.non_finite.last.action == "skipped" and s.non_finite.last.step == BAD_STEP for s in statuses)
    # The node that holds the poisoned bucket names it; the other only knows that the step was skipped.
    assert sorted((s.non_finite.last.rank, s.non_finite.last.values) for s in statuses) == [(-1, 0), (1, 1)]
    assert metrics_of(nodes[1])["netoptim_non_finite_skipped_steps_total"] == 1
    # Checkpoints: the protocol step counts every step, AdamW's step count only the applied ones.
    checkpoint = read_latest(Path(checkpoints))
    assert checkpoint is not None and checkpoint.step == STEPS
    assert {(s.step, s.step_tensor) for s in checkpoint.buckets.values()} == {(STEPS, float(STEPS - 1))}


def test_nodes_of_a_job_must_agree_on_the_policy(start_node):
    nodes = [start_node("refusing").address, start_node("skipping", extra_args=("--non-finite", "skip")).address]
    with pytest.raises(RuntimeError, match=r"--non-finite (skip|refuse).*--non-finite (refuse|skip)"):
        RemoteAdamW(make_model().parameters(), nodes=nodes, rank=0, world_size=1, bucket_numel=300, timeout_s=20)
