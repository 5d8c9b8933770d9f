"""Seeded, time-bounded fuzz of the wire format against a real node daemon (a child process on
127.0.0.1, port 0), and regression tests of what it found in the header decoder.

Each fuzz test sends, one message at a time and each followed by an ECHO on the same connection to
know it was handled: random frames; valid msgpack headers with fields of the wrong type, huge and
negative numbers, unknown message types, very long strings, deep nesting, NaN and inf in meta,
repeated and unknown keys; payload frames that disagree with the declared dtype, element count or
chunk count (dropped, extra, split, truncated, extended frames); truncated and bit-flipped headers;
16 MiB headers that decode to millions of objects; messages from connections with routing ids of
the client's choosing; and structure-aware mutations (one to three fields flipped) of real messages
of every type, before a job is registered and after. What is checked for each is listed in
:mod:`tests.security.wire_fuzz`; at the end the node must still be running, its peak resident memory
within :data:`RSS_GROWTH_BOUND` of where it started, and good workers must train bitwise like
``torch.optim.AdamW(fused=True)``.

``NETOPTIM_FUZZ_SEED=N`` replays a run (every failure names its seed; by default each run draws a new
one) and ``NETOPTIM_FUZZ_SECONDS=S`` sets the seconds each test fuzzes (default 4; 300 for a long
run). The seed fixes the sequence of inputs; how far a run gets in its time depends on the machine.
"""

from __future__ import annotations

import copy
import random
import secrets
import time

import msgpack
import pytest
import torch
import zmq

from gpu_worker import RemoteAdamW
from protos.job.hyper import AdamWHyper
from protos.job.spec import JobSpec
from tests.optimizer_node.raw_client import HYPER, JOB
from tests.security.fuzzing import WatchedNode, fuzz_seconds, fuzz_seed, seed_named_on_failure, watched_nodes
from tests.security.wire_fuzz import (
    JobModel,
    Line,
    Reply,
    WireFuzzer,
    await_params,
    batch_parts,
    certainly_invalid_hello,
    frames_of,
    run_loop,
    same_bits,
    send_accepted,
)
from tests.security.wire_mutations import Draft, Template, header_bomb
from transport.wire import (
    MAX_ERROR_CHARS,
    MAX_HEADER_BYTES,
    MAX_HEADER_DEPTH,
    PROTOCOL_VERSION,
    ErrorCode,
    Header,
    MsgType,
    WireError,
    decode_header,
    encode_message,
    error_header,
    tensor_header,
)
from transport.zeromq import backend as zmq_backend

pytestmark = pytest.mark.fresh_nodes  # the nodes' resident memory is measured

MAX_MESSAGE_BYTES = 1 << 20
NODE_ARGS = ("--max-message-bytes", str(MAX_MESSAGE_BYTES), "--max-header-bytes", str(MAX_HEADER_BYTES), "--next-job", "refuse")
"""Headers as large as the protocol allows (the node's default is smaller): the decoder's own bounds
are what is fuzzed. ``--next-job refuse``: the fuzzer's model holds one job for the node's life, so
a replayed BYE (which finishes the job) followed by another job's HELLO must be refused, as it is
with this flag (tests/optimizer_node cover a node taking the next job)."""

RSS_GROWTH_BOUND = 384 << 20
"""How far a fuzzed node's peak resident memory may rise above its peak once ready: a 16 MiB header
may decode to ~150 MB before it is stopped (transport.wire.MAX_HEADER_LENGTH); nothing else the
fuzzer sends is held."""

WORKER_HYPER = AdamWHyper(1e-2, 0.9, 0.99, 1e-6, 0.05)


def node_templates(job: JobSpec, incarnation: int) -> list[Template]:
    """One message of every type, as a worker or a node would send it for ``job``."""
    grad = torch.randn(128)
    hello = {"job": job.to_wire(), "node_index": 0, "incarnation": incarnation}
    templates = [
        Template.from_header("HELLO", Header(msg_type=MsgType.HELLO, rank=0, meta=hello)),
        Template.from_header("HELLO rank 1", Header(msg_type=MsgType.HELLO, rank=1, meta={**hello, "incarnation": incarnation + 2})),
        Template.from_header("INIT", tensor_header(MsgType.INIT, grad, rank=0, bucket_id=0), grad),
        Template.from_header("PUSH", tensor_header(MsgType.PUSH, grad, rank=0, step=0, bucket_id=0, meta={"hyper": HYPER.to_wire()}), grad),
        Template.from_header("PULL", Header(msg_type=MsgType.PULL, rank=0, bucket_id=1)),
        Template.from_header("PULL at_step", Header(msg_type=MsgType.PULL, rank=0, bucket_id=0, meta={"at_step": 1})),
        Template.from_header("CLIP", Header(msg_type=MsgType.CLIP, rank=0, step=0, meta={"sum_of_squares": 4.0})),
        Template.from_header("QUERY", Header(msg_type=MsgType.QUERY, rank=0)),
        Template.from_header("ECHO", tensor_header(MsgType.ECHO, grad[:10], step=3, bucket_id=1), grad[:10]),
        Template.from_header("ECHO empty", Header(msg_type=MsgType.ECHO)),
    ]
    node_side = [
        Header(msg_type=MsgType.HELLO_OK, rank=0, meta={"owned": [0, 1], "needs_init": [], "resume_step": 0, "contributed": [], "node_id": "n"}),
        Header(msg_type=MsgType.ACK, bucket_id=0),
        Header(msg_type=MsgType.NORM_PARTIAL, step=0, meta={"sum_of_squares": 1.0, "node_index": 0}),
        Header(msg_type=MsgType.STATUS, meta={"step": 0, "missing": [[0, 0, [1]]], "paused": None}),
        error_header(ErrorCode.STALE_STEP, "stale", bucket_id=0, step=0),
        Header(msg_type=MsgType.NOTICE, meta={"paused": True, "reason": "x"}),
        Header(msg_type=MsgType.CONSUMED, bucket_id=0, step=0),
    ]
    templates += [Template.from_header(h.msg_type.name, h) for h in node_side]
    templates.append(Template.from_header("PARAMS", tensor_header(MsgType.PARAMS, grad, step=1, bucket_id=0), grad))
    return templates


def may_register_as(rank: int):
    """A veto: a HELLO that could register ``rank`` (the test keeps that rank to itself)."""

    def veto(header: Header) -> bool:
        return header.msg_type == MsgType.HELLO and header.rank == rank and not certainly_invalid_hello(header)

    return veto


def random_valid_hyper(rng: random.Random) -> list[float]:
    return [
        rng.choice((1e-3, 1e-2, 0.0, 1e-30, 10.0)),
        rng.choice((0.9, 0.0, 0.5)),
        rng.choice((0.999, 0.0, 0.99)),
        rng.choice((1e-8, 0.0, 1e-3)),
        rng.choice((0.05, 0.0, 2.0, 0.1)),  # 0.1 with an lr of 10: lr * weight_decay == 1
    ]


def aimer(model: JobModel, rng: random.Random, hyper: AdamWHyper):
    """Points a template at the node's current state before it is mutated: a bucket the node owns,
    its current step, rank 0, a fresh gradient of the bucket's size: what is then flipped is the one
    check the message gets past or not."""
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    buckets = sorted(model.buckets)

    def aim(draft: Draft, _line: Line) -> None:
        kind = draft.get("t")
        if kind not in (MsgType.PUSH, MsgType.PULL, MsgType.CLIP, MsgType.INIT):
            return
        bucket = draft.get("b")
        if bucket not in model.buckets or rng.random() < 0.5:
            bucket = rng.choice(buckets)
            draft.set("b", bucket)
        step = model.step(bucket)
        draft.set("s", step)
        draft.set("r", 0)
        if kind == MsgType.PULL:
            choice = rng.randrange(4)
            draft.set("m", {} if choice == 0 else {"at_step": step + choice - 2})
        if kind in (MsgType.PUSH, MsgType.INIT):
            values = torch.randn(model.buckets[bucket].numel, generator=generator) * rng.choice((1e-3, 1.0, 1e3))
            draft.set("d", "float32")
            draft.set("n", values.numel())
            draft.set("c", 1)
            draft.frames = [values.numpy().tobytes()]
        if kind == MsgType.PUSH:
            pending = model.pending.get(bucket)
            if pending is not None and rng.random() < 0.8:
                wire = pending.hyper.to_wire()
            else:
                wire = hyper.to_wire() if rng.random() < 0.7 else random_valid_hyper(rng)
            draft.set("m", {**(draft.get("m") if isinstance(draft.get("m"), dict) else {}), "hyper": wire})

    return aim


def bucket_values(job: JobSpec, tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """The flat bucket values of a model's parameters (every bucket: one node)."""
    out = {}
    for bucket in job.plan():
        flat = torch.empty(bucket.numel)
        for seg in bucket.segments:
            flat[seg.bucket_offset : seg.bucket_offset + seg.numel] = (
                tensors[seg.param_index].detach().reshape(-1)[seg.param_offset : seg.param_offset + seg.numel]
            )
        out[bucket.bucket_id] = flat
    return out


def assert_model_is(job: JobSpec, model: torch.nn.Module, expected: dict[int, torch.Tensor], what: str) -> None:
    got = bucket_values(job, [p for p in model.parameters()])
    for bucket_id, values in expected.items():
        assert same_bits(got[bucket_id], values), f"{what}: bucket {bucket_id} differs: {got[bucket_id][:4].tolist()} != {values[:4].tolist()}"


def finish(node: WatchedNode, fuzzer: WireFuzzer) -> None:
    """The node is alive and within its memory bound; print what the fuzzer did."""
    assert node.alive(), node.health()
    growth = node.peak_growth()
    print(f"sent {fuzzer.tally.sent} messages; errors {fuzzer.tally.errors}; taken {fuzzer.tally.accepted}; peak RSS +{growth >> 20} MiB")
    assert growth <= RSS_GROWTH_BOUND, f"the node's peak resident memory rose {growth >> 20} MiB (bound {RSS_GROWTH_BOUND >> 20} MiB)"
    log = node.node.log_text()
    assert "Traceback" not in log, f"the node logged an exception:\n{log[log.index('Traceback') - 300 :][:3000]}"


start_node = pytest.fixture(watched_nodes)


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_fuzz_without_a_job_then_a_real_worker_and_its_messages_mutated(start_node, monkeypatch, context):
    """Before any job: every message type, mutated (HELLOs that could register rank 0 are not sent).
    Then a real worker registers and trains bitwise, its messages captured at the transport; they are
    mutated and replayed from a connection that took the worker's rank with its captured HELLO, and
    from a stranger's. Last, the worker restarts and trains on, bitwise."""
    seed = fuzz_seed()
    with seed_named_on_failure(seed):
        node = start_node("fuzzed", NODE_ARGS)
        rng = random.Random(f"{seed}:without a job")  # each part its own sequence: a replay does not depend on how far the last part got
        strangers = [Line(context, node.address, f"stranger-{i}") for i in range(2)]
        fuzzer = WireFuzzer(node, None, MAX_MESSAGE_BYTES)
        run_loop(fuzzer, rng, fuzz_seconds() / 2, strangers, node_templates(JOB, 11), context=context, veto=may_register_as(0), bombs=1)

        # A real worker: registers, trains two steps bitwise like torch's fused AdamW; everything it sends is kept.
        captured: list[list[bytes]] = []
        send = zmq_backend.ZmqClient.send

        def recording(self, header, payload=None):  # type: ignore[no-untyped-def]
            captured.append([bytes(f) for f in encode_message(header, payload, self._chunk_bytes)])
            return send(self, header, payload)

        monkeypatch.setattr(zmq_backend.ZmqClient, "send", recording)
        rng = random.Random(f"{seed}:real worker")
        torch.manual_seed(rng.randrange(1 << 30))
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        reference = copy.deepcopy(model)
        options = {"lr": WORKER_HYPER.lr, "betas": (WORKER_HYPER.beta1, WORKER_HYPER.beta2), "eps": WORKER_HYPER.eps, "weight_decay": WORKER_HYPER.weight_decay}
        reference_opt = torch.optim.AdamW(reference.parameters(), fused=True, **options)
        inputs, targets = torch.randn(4, 8), torch.randn(4, 3)
        opt = RemoteAdamW(model.parameters(), nodes=[node.address], rank=0, world_size=1, bucket_numel=64, same_host_ipc=False, timeout_s=30, **options)
        for _ in range(2):
            for net, optimizer in ((model, opt), (reference, reference_opt)):
                torch.nn.functional.mse_loss(net(inputs), targets).backward()
                optimizer.step()
                optimizer.zero_grad()
            for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
                assert same_bits(ours.detach(), theirs.detach()), "a good worker after the fuzz does not train like torch.optim.AdamW(fused=True)"
        opt.close()
        monkeypatch.undo()
        for line in strangers:  # HELLOs held until rank 0 registered were answered then
            fuzzer.check_line(line, "HELLOs held until the real worker registered")

        # Its messages, mutated, from the connection that replays its HELLO and from a stranger's.
        decoded = [(decode_header(frames[0]), frames) for frames in captured]
        hello_frames = next(frames for header, frames in decoded if header.msg_type == MsgType.HELLO)
        spec = JobSpec.from_wire(decode_header(hello_frames[0]).meta["job"])
        initial = {h.bucket_id: torch.frombuffer(bytearray(b"".join(f[1:])), dtype=torch.float32) for h, f in decoded if h.msg_type == MsgType.INIT}
        job_model = JobModel(spec, 0, initial)
        assert any("batch" in header.meta for header, _frames in decoded if header.msg_type == MsgType.PUSH), "the worker batches its small buckets"
        for header, frames in decoded:  # the oracle retraces the two steps
            if header.msg_type == MsgType.PUSH:
                grad = torch.frombuffer(bytearray(b"".join(frames[1:])), dtype=torch.float32)
                for part in batch_parts(header, grad) if "batch" in header.meta else [Reply(header, grad)]:
                    job_model.oracle.update(part.header.bucket_id, [part.payload], AdamWHyper.from_wire(header.meta["hyper"]), 1)
        assert_model_is(spec, reference, {b: job_model.oracle.values(b) for b in job_model.buckets}, "the oracle retracing the worker's pushes")
        hijack = Line(context, node.address, "replayed HELLO")
        fuzzer.model = job_model
        send_accepted(fuzzer, hijack, hello_frames, "the worker's HELLO replayed")  # same incarnation: the rank moves here
        templates = [Template.of(header.msg_type.name, frames) for header, frames in decoded] + node_templates(spec, 11)[6:]
        rng = random.Random(f"{seed}:captured messages")
        run_loop(fuzzer, rng, fuzz_seconds() / 2, [hijack, hijack, strangers[0]], templates, context=context, aim=aimer(job_model, rng, WORKER_HYPER))

        # Every bucket brought to the same step by good pushes, then the worker restarts and trains on.
        send_accepted(fuzzer, hijack, hello_frames, "the worker's HELLO replayed again")
        for bucket_id in job_model.buckets:  # the updates the fuzz's last pushes asked for are applied
            if job_model.step(bucket_id):
                replies = send_accepted(
                    fuzzer, hijack, frames_of(Header(msg_type=MsgType.PULL, rank=0, bucket_id=bucket_id, meta={"at_step": job_model.step(bucket_id)})), "PULL"
                )
                await_params(fuzzer, hijack, bucket_id, job_model.step(bucket_id), replies)
        target = max(job_model.step(b) for b in job_model.buckets)
        for bucket_id, bucket in job_model.buckets.items():
            while job_model.step(bucket_id) < target:
                grad = torch.randn(bucket.numel)
                push = tensor_header(MsgType.PUSH, grad, rank=0, step=job_model.step(bucket_id), bucket_id=bucket_id, meta={"hyper": WORKER_HYPER.to_wire()})
                replies = send_accepted(fuzzer, hijack, frames_of(push, grad), f"a good push of bucket {bucket_id}")
                await_params(fuzzer, hijack, bucket_id, job_model.step(bucket_id), replies)
        fuzzer.check_line(hijack, "PARAMS of the good pushes")
        restarted = RemoteAdamW(model.parameters(), nodes=[node.address], rank=0, world_size=1, bucket_numel=64, same_host_ipc=False, timeout_s=30, **options)
        assert restarted.remote_step == target
        assert_model_is(spec, model, {b: job_model.oracle.values(b) for b in job_model.buckets}, "the parameters a restarted worker gets")
        # A loss linear in the parameters: its gradient is finite whatever values the fuzzed pushes left.
        weights = [torch.randn(p.shape) for p in model.parameters()]
        sum((p * w).sum() for p, w in zip(model.parameters(), weights, strict=True)).backward()
        grads = bucket_values(spec, [p.grad for p in model.parameters()])
        for bucket_id in job_model.buckets:
            job_model.oracle.update(bucket_id, [grads[bucket_id]], WORKER_HYPER, 1)
        restarted.step()
        assert_model_is(spec, model, {b: job_model.oracle.values(b) for b in job_model.buckets}, "a step after the fuzz")
        restarted.close()
        finish(node, fuzzer)
        for line in [*strangers, hijack]:
            line.close()
        assert node.stop() == 0, node.health()


def test_fuzz_a_two_rank_job_while_a_rank_is_awaited(start_node, context):
    """A job of two ranks registered with raw HELLO and INIT; mutations of every message type come
    from rank 0's connection and a stranger's while rank 1 stays silent (HELLOs that could take rank
    1 are not sent), so accepted gradients wait in the node. Then both ranks finish the step and do
    one more: every value sent is AdamW's, bit for bit."""
    seed = fuzz_seed()
    rng = random.Random(seed)
    with seed_named_on_failure(seed):
        node = start_node("fuzzed", NODE_ARGS)
        rank0, rank1, stranger = (Line(context, node.address, name) for name in ("rank 0", "rank 1", "stranger"))
        generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
        initial = {b.bucket_id: torch.randn(b.numel, generator=generator) for b in JOB.plan()}
        model = JobModel(JOB, 0, initial)
        fuzzer = WireFuzzer(node, model, MAX_MESSAGE_BYTES)
        incarnations = [secrets.randbits(62) | 1 for _ in range(2)]

        def hello(rank: int) -> list[bytes]:
            return frames_of(Header(msg_type=MsgType.HELLO, rank=rank, meta={"job": JOB.to_wire(), "node_index": 0, "incarnation": incarnations[rank]}))

        send_accepted(fuzzer, rank0, hello(0), "rank 0's HELLO")
        for bucket_id, values in initial.items():  # not through the fuzzer: for it, every bucket has its values already
            replies = rank0.exchange(frames_of(tensor_header(MsgType.INIT, values, rank=0, bucket_id=bucket_id), values))
            assert replies is not None and [r.header.msg_type for r in replies] == [MsgType.ACK], replies
        send_accepted(fuzzer, rank1, hello(1), "rank 1's HELLO")

        run_loop(
            fuzzer,
            rng,
            fuzz_seconds(),
            [rank0, rank0, stranger],
            node_templates(JOB, incarnations[0]),
            context=context,
            aim=aimer(model, rng, HYPER),
            veto=may_register_as(1),
        )
        fuzzer.check_line(rank1, "what the silent rank 1 was sent during the fuzz")

        # What the node holds is what the model holds: the gradients it took wait for rank 1.
        status = next(
            r
            for r in send_accepted(fuzzer, rank1, [msgpack.packb({"v": PROTOCOL_VERSION, "t": int(MsgType.QUERY), "r": 1})], "QUERY")
            if r.header.msg_type == MsgType.STATUS
        )
        missing = {(b, s, tuple(ranks)) for b, s, ranks in status.header.meta["missing"]}
        assert missing == {(b, model.step(b), (1,)) for b in model.pending}, f"the node waits for {missing}, the model for {sorted(model.pending)}"

        # Both ranks finish the step, then do one more; every PARAMS is checked against the oracle.
        send_accepted(fuzzer, rank0, hello(0), "rank 0's HELLO again")
        for _ in range(2):
            for bucket_id, bucket in model.buckets.items():
                pending = model.pending.get(bucket_id)
                hyper = HYPER if pending is None else pending.hyper
                step = model.step(bucket_id)
                seen: dict[str, list[Reply]] = {rank0.name: [], rank1.name: []}
                for rank, line in ((0, rank0), (1, rank1)):
                    if pending is not None and rank in pending.grads:
                        continue
                    grad = torch.randn(bucket.numel, generator=generator)
                    push = tensor_header(MsgType.PUSH, grad, rank=rank, step=step, bucket_id=bucket_id, meta={"hyper": hyper.to_wire()})
                    seen[line.name] += send_accepted(fuzzer, line, frames_of(push, grad), f"rank {rank}'s push of bucket {bucket_id} step {step}")
                assert model.step(bucket_id) == step + 1
                for line in (rank0, rank1):  # both ranks get the new values before either pushes again
                    await_params(fuzzer, line, bucket_id, step + 1, seen[line.name])
            for line in (rank0, rank1, stranger):
                fuzzer.check_line(line, "PARAMS of the good steps")
        for bucket_id in model.buckets:
            replies = send_accepted(fuzzer, rank0, frames_of(Header(msg_type=MsgType.PULL, rank=0, bucket_id=bucket_id)), f"PULL of bucket {bucket_id}")
            assert [r.header.step for r in replies if r.header.msg_type == MsgType.PARAMS] == [model.step(bucket_id)]
        finish(node, fuzzer)
        for line in (rank0, rank1, stranger):
            line.close()
        assert node.stop() == 0, node.health()


# ---------------------------------------------------------------------------- what the fuzz found in the decoder


def test_a_header_decodes_to_a_bounded_number_of_values():
    started = time.perf_counter()
    with pytest.raises(WireError) as info:
        decode_header(header_bomb(random.Random(0))[0])
    assert info.value.code == ErrorCode.TOO_LARGE and time.perf_counter() - started < 10


@pytest.mark.parametrize("depth", [MAX_HEADER_DEPTH, 1000, 5000])
def test_deep_nesting_is_refused_at_decoding(depth):
    meta = b"\x81\xa1x" + b"\x91" * depth + b"\xc0"
    header = msgpack.packb({"v": PROTOCOL_VERSION, "t": int(MsgType.PUSH)})[1:]
    with pytest.raises(WireError) as info:
        decode_header(bytes([0x83]) + header + msgpack.packb("m") + meta)
    assert info.value.code == ErrorCode.MALFORMED and "levels deep" in info.value.message
    assert decode_header(msgpack.packb({"v": PROTOCOL_VERSION, "t": int(MsgType.PUSH), "m": {"a": [[[1]]]}})).meta == {"a": [[[1]]]}


@pytest.mark.parametrize("version", [1.0, True, "1", None])
def test_a_version_must_be_the_integer(version):
    with pytest.raises(WireError) as info:
        decode_header(msgpack.packb({"v": version, "t": int(MsgType.ECHO)}))
    assert info.value.code == ErrorCode.VERSION


def test_errors_quote_what_a_peer_sent_in_bounded_length():
    with pytest.raises(WireError) as info:
        decode_header(msgpack.packb({"v": "x" * (1 << 20), "t": int(MsgType.ECHO)}))
    assert info.value.code == ErrorCode.VERSION and len(info.value.message) < 300
    assert len(WireError(ErrorCode.BAD_REQUEST, "y" * 100_000).message) <= MAX_ERROR_CHARS + 40
    assert len(error_header(ErrorCode.INTERNAL, "z" * 100_000).meta["message"]) <= MAX_ERROR_CHARS + 40


# ---------------------------------------------------------------------------- what the fuzz found elsewhere


def test_the_compiled_update_rounds_the_decay_factor_as_torch():
    """With lr * weight_decay == 1 (lr 10, weight_decay 0.1), torch's fused kernel gets the decay
    factor 1 - lr * weight_decay with one rounding (-5.55e-17: its build contracts it to a fused
    multiply-add); the node's compiled loop rounds the product first (0.0), so where the update term
    vanishes (here: exp_avg_sq overflowed to inf) the parameters differ, and the difference grows
    over the next steps."""
    from optimizer_node.update.bucket_pass import reduce_and_update
    from optimizer_node.update.kernels import compiled_update
    from optimizer_node.update.reduce import OrderedReduction

    if not compiled_update.usable():
        pytest.skip("the compiled update is not available here")
    hyper = AdamWHyper(10.0, 0.0, 0.999, 1e-8, 0.1)
    param = torch.randn(64, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(64, generator=torch.Generator().manual_seed(2)) * 1e37  # finite; its square is not
    reference = param.clone()
    optimizer = torch.optim.AdamW([reference], lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps, weight_decay=hyper.weight_decay, fused=True)
    reference.grad = grad.clone()
    optimizer.step()
    reduction = OrderedReduction(64, 1, lambda: torch.empty(64), defer=True)
    reduction.add(0, [(0, grad.clone())])
    reduce_and_update(reduction, param, torch.zeros(64), torch.zeros(64), torch.zeros(()), hyper, grad_divisor=torch.tensor(1.0), compiled=True)
    assert same_bits(param, reference.detach())
