"""Bad input against a running node: each case gets a clear error, the node keeps serving, and its
parameters and optimizer state are unchanged (checked by completing a good step afterwards and
comparing with the same math applied locally)."""

from __future__ import annotations

import msgpack
import pytest
import torch

from gpu_worker import RemoteAdamW
from protos.job.placement import ParamSpec
from tests.optimizer_node.raw_client import HYPER, JOB, Mirror, RawWorker
from transport.wire import PROTOCOL_VERSION, ErrorCode, Header, MsgType, encode_header, tensor_header
from transport.zeromq.backend import ZmqTransport


@pytest.fixture
def job(start_node):
    """A node with a registered 2-worker job whose buckets hold initial values."""
    node = start_node(extra_args=("--max-message-bytes", "1MiB"))
    transport = ZmqTransport()
    rank0, rank1 = RawWorker(transport, node.address, 0), RawWorker(transport, node.address, 1)
    assert rank0.hello().meta["needs_init"] == [0, 1]
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(b.numel, generator=generator) for b in JOB.plan()]
    for bucket_id, values in enumerate(initial):
        assert rank0.request(tensor_header(MsgType.INIT, values, rank=0, bucket_id=bucket_id), values).msg_type == MsgType.ACK
    assert rank1.hello().meta["needs_init"] == []  # rank 0 initialized every bucket
    state = {"node": node, "rank0": rank0, "rank1": rank1, "mirror": Mirror(initial), "step": 0, "generator": generator}
    yield state
    for worker in (rank0, rank1):
        worker.client.close()
    transport.close()


def good_step(job: dict) -> None:
    """Both ranks push every bucket; the node's answer must equal the mirror's math."""
    mirror: Mirror = job["mirror"]
    for bucket in mirror.buckets:
        grads = [torch.randn(bucket.numel, generator=job["generator"]) for _ in range(2)]
        job["rank1"].push(bucket.bucket_id, job["step"], grads[1])  # out of rank order on purpose
        job["rank0"].push(bucket.bucket_id, job["step"], grads[0])
        mirror.apply(bucket.bucket_id, grads)
        for worker in (job["rank0"], job["rank1"]):
            header, values = worker.reply()
            assert header.msg_type == MsgType.PARAMS and header.step == job["step"] + 1
            assert torch.equal(values, mirror.param[bucket.bucket_id])
    job["step"] += 1


def assert_error(reply: Header, code: ErrorCode, *words: str) -> None:
    assert reply.msg_type == MsgType.ERROR, reply
    assert reply.meta["code"] == code, reply.meta
    for word in words:
        assert word in reply.meta["message"], reply.meta["message"]


def assert_intact(job: dict) -> None:
    for bucket_id, expected in enumerate(job["mirror"].param):
        assert torch.equal(job["rank0"].pull(bucket_id), expected)
    good_step(job)


def test_garbage_bytes(job):
    job["rank0"].client.send_raw([b"\x00\xffnot a header"])
    assert_error(job["rank0"].reply(), ErrorCode.MALFORMED, "msgpack")
    assert_intact(job)


def test_header_with_wrong_field_types(job):
    job["rank0"].client.send_raw([msgpack.packb({"v": PROTOCOL_VERSION, "t": int(MsgType.PUSH), "s": "zero"})])
    assert_error(job["rank0"].reply(), ErrorCode.MALFORMED, "step")
    assert_intact(job)


def test_other_protocol_version(job):
    job["rank0"].client.send_raw([msgpack.packb({"v": PROTOCOL_VERSION + 1, "t": int(MsgType.PUSH)})])
    assert_error(job["rank0"].reply(), ErrorCode.VERSION, "protocol version")
    assert_intact(job)


def test_truncated_frame(job):
    grad = torch.ones(128)
    header = tensor_header(MsgType.PUSH, grad, rank=0, step=0, bucket_id=0, meta={"hyper": HYPER.to_wire()})
    job["rank0"].client.send_raw([encode_header(header), grad.numpy().tobytes()[:300]])
    assert_error(job["rank0"].reply(), ErrorCode.BAD_PAYLOAD, "512 bytes", "300 bytes arrived")
    assert_intact(job)


def test_missing_chunk(job):
    header = Header(msg_type=MsgType.PUSH, rank=0, step=0, bucket_id=0, dtype="float32", numel=128, num_chunks=2, meta={"hyper": HYPER.to_wire()})
    job["rank0"].client.send_raw([encode_header(header), torch.ones(128).numpy().tobytes()])
    assert_error(job["rank0"].reply(), ErrorCode.BAD_PAYLOAD, "2 chunks")
    assert_intact(job)


def test_payload_over_the_limit(job):
    header = Header(msg_type=MsgType.PUSH, rank=0, step=0, bucket_id=0, dtype="float32", numel=1 << 20, num_chunks=1)
    job["rank0"].client.send_raw([encode_header(header), b"\0" * 16])
    assert_error(job["rank0"].reply(), ErrorCode.TOO_LARGE, "limit")
    assert_intact(job)


def test_unknown_bucket(job):
    job["rank0"].push(7, 0, torch.ones(128))
    assert_error(job["rank0"].reply(), ErrorCode.UNKNOWN_BUCKET, "bucket 7")
    assert_intact(job)


def test_gradient_of_the_wrong_size(job):
    job["rank0"].push(0, 0, torch.ones(100))
    assert_error(job["rank0"].reply(), ErrorCode.WRONG_SHAPE, "128 elements", "got 100")
    assert_intact(job)


def test_gradient_of_the_wrong_dtype(job):
    job["rank0"].push(0, 0, torch.ones(128, dtype=torch.float16))
    assert_error(job["rank0"].reply(), ErrorCode.WRONG_DTYPE, "float32", "float16")
    assert_intact(job)


def test_stale_and_future_steps(job):
    good_step(job)
    job["rank0"].push(0, 0, torch.ones(128))
    assert_error(job["rank0"].reply(), ErrorCode.STALE_STEP, "stale")
    job["rank0"].push(0, 9, torch.ones(128))
    assert_error(job["rank0"].reply(), ErrorCode.FUTURE_STEP, "future")
    assert_intact(job)


def test_duplicate_push_keeps_the_first(job):
    bucket = job["mirror"].buckets[0]
    first, second, other = torch.full((128,), 0.5), torch.full((128,), 9.0), torch.full((128,), -0.25)
    job["rank0"].push(0, 0, first)
    job["rank0"].push(0, 0, second)
    assert_error(job["rank0"].reply(), ErrorCode.DUPLICATE, "rank 0 already pushed")
    job["rank1"].push(0, 0, other)
    job["mirror"].apply(0, [first, other])
    for worker in (job["rank0"], job["rank1"]):
        header, values = worker.reply()
        assert header.bucket_id == bucket.bucket_id and torch.equal(values, job["mirror"].param[0])
    # finish the step for bucket 1 so the job is consistent again
    grads = [torch.ones(bucket.numel) for bucket in job["mirror"].buckets[1:2] for _ in range(2)]
    job["rank0"].push(1, 0, grads[0])
    job["rank1"].push(1, 0, grads[1])
    job["mirror"].apply(1, grads)
    for worker in (job["rank0"], job["rank1"]):
        assert torch.equal(worker.reply()[1], job["mirror"].param[1])
    job["step"] = 1
    assert_intact(job)


def test_mismatched_hyperparameters_between_ranks(job):
    job["rank0"].push(0, 0, torch.ones(128))
    # The two ranks use separate connections: rank 0's answered pull (after its push, on its own
    # connection) proves the node took rank 0's hyperparameters first, so the error is rank 1's.
    job["rank0"].pull(1)
    job["rank1"].push(0, 0, torch.ones(128), hyper=type(HYPER)(5e-2, 0.9, 0.999, 1e-8, 0.1))
    assert_error(job["rank1"].reply(), ErrorCode.BAD_REQUEST, "hyperparameters")


def test_invalid_hyperparameters(job):
    job["rank0"].client.send(
        tensor_header(MsgType.PUSH, torch.ones(128), rank=0, step=0, bucket_id=0, meta={"hyper": [-1.0, 0.9, 0.999, 1e-8, 0.0]}), torch.ones(128)
    )
    assert_error(job["rank0"].reply(), ErrorCode.BAD_REQUEST, "learning rate")
    job["rank0"].client.send(
        tensor_header(MsgType.PUSH, torch.ones(128), rank=0, step=0, bucket_id=0, meta={"hyper": [1e-3, 1.0, 0.999, 1e-8, 0.0]}), torch.ones(128)
    )
    assert_error(job["rank0"].reply(), ErrorCode.BAD_REQUEST, "beta1")
    assert_intact(job)


def test_push_without_hello(job):
    stranger = RawWorker(ZmqTransport(), job["node"].address, 1)
    stranger.push(0, 0, torch.ones(128))
    assert_error(stranger.reply(), ErrorCode.NOT_REGISTERED, "HELLO")
    stranger.client.close()
    assert_intact(job)


def test_hello_without_an_incarnation(job):
    stranger = RawWorker(ZmqTransport(), job["node"].address, 1)
    reply = stranger.request(Header(msg_type=MsgType.HELLO, rank=1, meta={"job": JOB.to_wire(), "node_index": 0}))
    assert_error(reply, ErrorCode.BAD_REQUEST, "incarnation")
    stranger.client.close()
    assert_intact(job)


def test_a_replaced_process_is_refused(job):
    """A second process says HELLO as rank 1: from then on it is rank 1, and the first is refused."""
    successor = RawWorker(ZmqTransport(), job["node"].address, 1)
    assert successor.hello().msg_type == MsgType.HELLO_OK
    job["rank1"].push(0, 0, torch.ones(128))
    assert_error(job["rank1"].reply(), ErrorCode.NOT_REGISTERED, "no longer part of the job")
    job["rank1"] = successor
    assert_intact(job)
    successor.client.close()


def test_second_worker_with_a_different_layout(job):
    other = type(JOB)(
        **{**{f: getattr(JOB, f) for f in JOB.__slots__}, "params": (ParamSpec("w", (200,), "float32", 0), ParamSpec("bias", (10,), "float32", 0))}
    )
    # Which parameter and the worker's own value; the registered layout ('b') goes to the node's log only.
    reply = job["rank1"].hello(other)
    assert_error(reply, ErrorCode.LAYOUT_MISMATCH, "parameter 1", "'bias'", "fingerprint")
    assert "'b'" not in reply.meta["message"] and "registered 'b'" in job["node"].log_text()
    assert_intact(job)


def test_worker_with_another_world_size(job):
    other = type(JOB)(**{**{f: getattr(JOB, f) for f in JOB.__slots__}, "world_size": 3})
    assert_error(job["rank1"].hello(other), ErrorCode.LAYOUT_MISMATCH, "world_size")
    assert_intact(job)


def test_layout_mismatch_through_remote_adamw(node):
    first = torch.nn.Linear(4, 3)
    RemoteAdamW(first.named_parameters(), nodes=[node.address], rank=0, world_size=2, timeout_s=10)
    second = torch.nn.Linear(4, 5)
    with pytest.raises(RuntimeError, match=r"LAYOUT_MISMATCH.*fingerprint.*parameter 0 differs \(this worker has 'weight' shape \[5, 4\]") as raised:
        RemoteAdamW(second.named_parameters(), nodes=[node.address], rank=1, world_size=2, timeout_s=10)
    assert "[3, 4]" not in str(raised.value)  # the registered shape is in the node's log, not in the answer
    assert "'weight' shape [3, 4]" in node.log_text()


def test_another_bucket_size_through_remote_adamw_says_what_to_give(node):
    RemoteAdamW(torch.nn.Linear(4, 3).parameters(), nodes=[node.address], rank=0, world_size=2, timeout_s=10, bucket_numel=1024)
    with pytest.raises(RuntimeError, match=r"bucket_numel differs \(this worker has 2048\): give every rank the bucket_numel the job was registered with"):
        RemoteAdamW(torch.nn.Linear(4, 3).parameters(), nodes=[node.address], rank=1, world_size=2, timeout_s=10, bucket_numel=2048)
    assert "registered 1024, got 2048; give the optimizer bucket_numel=1024 to join this job" in node.log_text()


def test_worker_that_never_comes(node):
    model = torch.nn.Linear(4, 2)
    opt = RemoteAdamW(model.parameters(), nodes=[node.address], rank=0, world_size=3, timeout_s=2)
    model(torch.ones(1, 4)).sum().backward()
    with pytest.raises(TimeoutError, match=r"waiting for gradients from rank\(s\) \[1, 2\]"):
        opt.step()
    opt.close()


def test_hello_with_an_impossible_plan(node):
    transport = ZmqTransport()
    worker = RawWorker(transport, node.address, 0)
    duplicate = type(JOB)(**{**{f: getattr(JOB, f) for f in JOB.__slots__}, "params": (ParamSpec("w", (5,), "float32", 0), ParamSpec("w", (5,), "float32", 0))})
    assert_error(worker.hello(duplicate), ErrorCode.BAD_REQUEST, "duplicate parameter name")
    assert worker.hello().msg_type == MsgType.HELLO_OK  # and the node still registers a good job
    worker.client.close()
    transport.close()


def test_bad_absent_lists_and_state_requests(job):
    """The per-segment ``absent`` list of a PUSH and the optimizer-state messages are checked like the rest."""
    rank0, rank1 = job["rank0"], job["rank1"]
    bucket = job["mirror"].buckets[0]
    grad = torch.zeros(bucket.numel)
    for absent, code, words in (
        ("all", ErrorCode.BAD_REQUEST, ("absent",)),
        ([0, 0], ErrorCode.BAD_REQUEST, ("at most",)),
        ([3], ErrorCode.BAD_REQUEST, ("below",)),
        ([1 << 40], ErrorCode.BAD_REQUEST, ("ascending",)),
    ):
        header = tensor_header(MsgType.PUSH, grad, rank=0, step=0, bucket_id=0, meta={"hyper": HYPER.to_wire(), "absent": absent})
        assert_error(rank0.request(header, grad), code, *words)
    empty = Header(msg_type=MsgType.PUSH, rank=0, step=0, bucket_id=0, meta={"hyper": HYPER.to_wire()})  # no payload, nothing named absent
    assert_error(rank0.request(empty), ErrorCode.WRONG_SHAPE, "absent")
    assert_error(rank0.request(Header(msg_type=MsgType.READ_STATE, rank=0, bucket_id=0, meta={"part": "grad"})), ErrorCode.BAD_REQUEST, "part")
    values = torch.zeros(bucket.numel)
    load = tensor_header(MsgType.LOAD_STATE, values, rank=1, bucket_id=0, meta={"part": "exp_avg"})
    assert_error(rank1.request(load, values), ErrorCode.BAD_REQUEST, "only rank 0")
    load = tensor_header(MsgType.LOAD_STATE, values, rank=0, bucket_id=0, meta={"part": "exp_avg", "segment_steps": [-1.0] * len(bucket.segments)})
    assert_error(rank0.request(load, values), ErrorCode.BAD_REQUEST, "segment_steps")
    assert_intact(job)
    # A state read returns what the node holds: the parameters the mirror computed, at their step count.
    reply, values = rank0.request(Header(msg_type=MsgType.READ_STATE, rank=0, bucket_id=0, meta={"part": "param"}))
    assert reply.msg_type == MsgType.STATE and reply.meta["segment_steps"] == [float(job["step"])] * len(bucket.segments)
    assert torch.equal(values, job["mirror"].param[0])


# ---------------------------------------------------------------- batches of pushes (transport.batches)


def batch_push(worker: RawWorker, step: int, entries: list, grads: torch.Tensor) -> None:
    """One PUSH carrying several buckets' gradients back to back."""
    header = tensor_header(MsgType.PUSH, grads, rank=worker.rank, step=step, bucket_id=0, meta={"hyper": HYPER.to_wire(), "batch": entries})
    worker.client.send(header, grads)


def test_a_good_batch_is_taken_like_pushes_one_by_one(job):
    """Rank 0 pushes both buckets in one message, rank 1 one by one: the same update as two pushes."""
    mirror: Mirror = job["mirror"]
    grads = [[torch.randn(b.numel, generator=job["generator"]) for b in mirror.buckets] for _ in range(2)]
    batch_push(job["rank0"], 0, [[b.bucket_id, b.numel] for b in mirror.buckets], torch.cat(grads[0]))
    for bucket in mirror.buckets:
        job["rank1"].push(bucket.bucket_id, 0, grads[1][bucket.bucket_id])
        mirror.apply(bucket.bucket_id, [grads[0][bucket.bucket_id], grads[1][bucket.bucket_id]])
    for worker in (job["rank0"], job["rank1"]):
        got = {}
        for _ in mirror.buckets:  # raw workers did not ask for batches: one PARAMS per bucket
            header, values = worker.reply()
            assert header.msg_type == MsgType.PARAMS and header.step == 1 and "batch" not in header.meta
            got[header.bucket_id] = values
        for bucket in mirror.buckets:
            assert torch.equal(got[bucket.bucket_id], mirror.param[bucket.bucket_id])
    job["step"] = 1
    assert_intact(job)


BAD_BATCHES = [
    # (what, entries, elements sent, code, words)
    ("a bucket of the wrong size", [[0, 128], [1, 81]], 209, ErrorCode.WRONG_SHAPE, ["bucket 1 has 82 elements"]),
    ("a bucket twice", [[0, 128], [0, 128]], 256, ErrorCode.BAD_REQUEST, ["ascending"]),
    ("descending buckets", [[1, 82], [0, 128]], 210, ErrorCode.BAD_REQUEST, ["ascending"]),
    ("entries holding less than the payload", [[0, 128]], 210, ErrorCode.BAD_REQUEST, ["header declares 210"]),
    ("entries holding more than the payload", [[0, 128], [1, 82]], 200, ErrorCode.BAD_REQUEST, ["more than the 200"]),
    ("an entry of three values", [[0, 128, 1], [1, 82]], 210, ErrorCode.BAD_REQUEST, ["[bucket_id, numel]"]),
    ("a bucket this node does not own", [[0, 128], [7, 82]], 210, ErrorCode.UNKNOWN_BUCKET, ["bucket 7 is not owned"]),
    ("not a list", {"0": 128}, 128, ErrorCode.BAD_REQUEST, ["must list"]),
    ("no entries", [], 128, ErrorCode.BAD_REQUEST, ["must list"]),
]


def test_a_bad_batch_is_refused_whole(job):
    """Each bad batch gets one ERROR, and none of its buckets is taken: each can then be pushed as
    before (one node for all the cases: a good step after each shows the state intact)."""
    for what, entries, numel, code, words in BAD_BATCHES:
        batch_push(job["rank0"], job["step"], entries, torch.ones(numel))
        reply = job["rank0"].reply()
        assert reply.msg_type == MsgType.ERROR and reply.meta["code"] == code, (what, reply.meta)
        for word in words:
            assert word in reply.meta["message"], (what, reply.meta["message"])
        assert_intact(job)  # rank 0 pushes bucket 0 again: refused as DUPLICATE had any of the batch been taken


def test_a_nan_in_one_bucket_of_a_batch_refuses_that_bucket_only(job):
    """NaN in bucket 1 of a batch: NON_FINITE naming bucket 1, bucket 0 taken; rank 0 then pushes
    bucket 1 again, finite, and the step completes as the mirror's math says."""
    mirror: Mirror = job["mirror"]
    grads = [[torch.randn(b.numel, generator=job["generator"]) for b in mirror.buckets] for _ in range(2)]
    poisoned = grads[0][1].clone()
    poisoned[5] = float("nan")
    batch_push(job["rank0"], 0, [[b.bucket_id, b.numel] for b in mirror.buckets], torch.cat([grads[0][0], poisoned]))
    reply = job["rank0"].reply()
    assert reply.msg_type == MsgType.ERROR and reply.meta["code"] == ErrorCode.NON_FINITE and reply.bucket_id == 1, reply
    job["rank0"].push(1, 0, grads[0][1])
    for bucket in mirror.buckets:
        job["rank1"].push(bucket.bucket_id, 0, grads[1][bucket.bucket_id])
        mirror.apply(bucket.bucket_id, [grads[0][bucket.bucket_id], grads[1][bucket.bucket_id]])
    for worker in (job["rank0"], job["rank1"]):
        got = {}
        while len(got) < len(mirror.buckets):
            reply = worker.reply()
            if isinstance(reply, Header):  # rank 1 hears of rank 0's refusal
                assert reply.msg_type == MsgType.NOTICE, reply
                continue
            header, values = reply
            got[header.bucket_id] = values
        for bucket in mirror.buckets:
            assert torch.equal(got[bucket.bucket_id], mirror.param[bucket.bucket_id])
    job["step"] = 1
    assert_intact(job)
