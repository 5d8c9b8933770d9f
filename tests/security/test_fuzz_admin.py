"""Seeded, time-bounded fuzz of a real node's admin service (gRPC on 127.0.0.1, port 0, behind a
token), and regression tests of what it found.

Every call goes through a generic channel with identity serializers, so the bytes are the fuzzer's
choice: typed requests with odd values (negative, NaN, inf and huge timeouts and hyperparameters, lr
times lr_scale beyond a float, empty, very long and non-printable pause reasons, unknown
hyperparameters as unknown protobuf fields, ``../`` and absolute paths wherever a string goes: the
service takes no path, the checkpoint directory is the node's flag), the same requests bit-flipped,
truncated or extended, random bytes, unknown methods, each with the token, without it, or with a wrong
or malformed one. The node holds a registered two-rank job, first between steps (checkpoints are
taken), then with a step in flight (checkpoints wait). For every call:

* the status is the one a model of the service predicts (OK, INVALID_ARGUMENT, UNAUTHENTICATED,
  DEADLINE_EXCEEDED, UNIMPLEMENTED, RESOURCE_EXHAUSTED): never UNKNOWN or INTERNAL;
* a refused call changed nothing (status and hyperparameters as before), an accepted one exactly
  what it asked for;
* health checks keep answering, also while streams and waiting calls are open.

At the end: no file outside the checkpoint directory, peak memory within bounds, and the job's
ranks finish the step and do one more, every value bit for bit AdamW's.

``NETOPTIM_FUZZ_SEED=N`` replays a run (every failure names its seed; by default each run draws a
new one); ``NETOPTIM_FUZZ_SECONDS=S`` sets the seconds of fuzzing (default 4).
"""

from __future__ import annotations

import math
import os
import random
import secrets
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from optimizer_node.admin.service import MAX_LONG_CALLS, MAX_REASON_CHARS, MAX_WAIT_S
from protos import admin_pb2, admin_pb2_grpc
from tests.optimizer_node.raw_client import HYPER, JOB
from tests.security.fuzzing import WatchedNode, fuzz_seconds, fuzz_seed, seed_named_on_failure, watched_nodes
from tests.security.wire_fuzz import JobModel, Line, Reply, WireFuzzer, await_params, frames_of, send_accepted
from transport.wire import Header, MsgType, tensor_header

pytestmark = pytest.mark.fresh_nodes  # the nodes' resident memory is measured

TOKEN = "fuzz-" + "t" * 24
GOOD = [("authorization", f"Bearer {TOKEN}")]
BAD_METADATA = (
    [],
    [("authorization", "Bearer wrong")],
    [("authorization", TOKEN)],
    [("authorization", f"bearer {TOKEN}")],
    [("authorization", f"Bearer {TOKEN} ")],
    [("authorization", "Bearer")],
    [("authorization", "Bearer " + "x" * 6000)],
    [("authorization", f"Bearer {TOKEN[:-1]}")],
)
SERVICE = "/netoptim.admin.v1.OptimizerNodeAdmin/"
CALL_TIMEOUT_S = 3.0
RSS_GROWTH_BOUND = 256 << 20

REQUESTS = {
    "GetStatus": (admin_pb2.GetStatusRequest, admin_pb2.GetStatusResponse),
    "ListWorkers": (admin_pb2.ListWorkersRequest, admin_pb2.ListWorkersResponse),
    "GetHyperparameters": (admin_pb2.GetHyperparametersRequest, admin_pb2.GetHyperparametersResponse),
    "SetHyperparameters": (admin_pb2.SetHyperparametersRequest, admin_pb2.SetHyperparametersResponse),
    "Pause": (admin_pb2.PauseRequest, admin_pb2.PauseResponse),
    "Resume": (admin_pb2.ResumeRequest, admin_pb2.ResumeResponse),
    "Checkpoint": (admin_pb2.CheckpointRequest, admin_pb2.CheckpointResponse),
    "Drain": (admin_pb2.DrainRequest, admin_pb2.DrainResponse),
    "Shutdown": (admin_pb2.ShutdownRequest, admin_pb2.ShutdownResponse),
    "WatchSteps": (admin_pb2.WatchStepsRequest, admin_pb2.StepEvent),
}
HYPER_FIELDS = ("lr", "lr_scale", "beta1", "beta2", "eps", "weight_decay")
FLOATS = (math.nan, math.inf, -math.inf, -1.0, -0.0, 0.0, 5e-324, 1e-8, 1e-3, 0.5, 0.9, 0.999, 1 - 2**-53, 1.0, 1.5, 10.0, 1e30, 1e300, 1.7976931348623157e308)
TIMEOUTS = (math.nan, math.inf, -math.inf, -1.0, -0.0, 0.0, 1e-3, 0.05, 0.2, MAX_WAIT_S, MAX_WAIT_S + 1, 1e300)


def escape_marker(seed: int) -> str:
    return f"netoptim-fuzz-escape-{seed}"


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def unknown_field(rng: random.Random, marker: str) -> bytes:
    """A protobuf field no message here has: a double (an unknown hyperparameter) or a string (a path)."""
    number = rng.choice((8, 9, 15, 16, 99, 2047, 536870911))
    if rng.random() < 0.5:
        return varint(number << 3 | 1) + struct.pack("<d", rng.choice(FLOATS))
    text = rng.choice((f"../../{marker}", f"/tmp/{marker}", f"{'../' * 20}{marker}", f"/{marker}/../../etc/passwd")).encode()
    return varint(number << 3 | 2) + varint(len(text)) + text


def reason(rng: random.Random, marker: str) -> str:
    return rng.choice(
        (
            "",
            "maintenance",
            "é🙂 unicode",
            f"../../{marker}",
            f"/tmp/{marker}",
            "x" * MAX_REASON_CHARS,
            "x" * (MAX_REASON_CHARS + 1),
            "y" * 100_000,
            "line\nbreak",
            "nul\x00byte",
            "tab\there",
            "bidi\u202eoverride",
            "\x1b[31mred",
        )
    )


@dataclass(slots=True)
class Call:
    """One admin call: the method's name (or a full path of a method that does not exist), the
    request's bytes, the request as the service would parse it (``None``: it cannot), the metadata."""

    method: str
    data: bytes
    request: object | None
    metadata: list[tuple[str, str]]
    note: str

    @property
    def path(self) -> str:
        return self.method if self.method.startswith("/") else SERVICE + self.method

    @property
    def authorized(self) -> bool:
        return self.metadata == GOOD


def make_call(rng: random.Random, marker: str, phase: str) -> Call | None:
    """A random call; ``None`` for one the model cannot predict safely (a Drain or Shutdown the
    service would carry out)."""
    metadata = GOOD if rng.random() < 0.75 else list(rng.choice(BAD_METADATA))
    if rng.random() < 0.04:
        method = rng.choice(("/netoptim.admin.v1.OptimizerNodeAdmin/Nope", "/x/y", "/", SERVICE + "getstatus", "/grpc.health.v1.Health/Nope"))
        return Call(method, rng.randbytes(rng.randrange(20)), None, metadata, "unknown method")
    method = rng.choice(list(REQUESTS))
    kind, _ = REQUESTS[method]
    request = kind()
    if method == "SetHyperparameters":
        for name in (*HYPER_FIELDS, "max_grad_norm"):
            if rng.random() < 0.3:
                setattr(request.overrides, name, rng.choice(FLOATS))
        request.clear = rng.random() < 0.15
    elif method == "Pause":
        request.reason = reason(rng, marker)
    elif method in ("Checkpoint", "Drain"):
        request.timeout_seconds = rng.choice(TIMEOUTS)
    data = request.SerializeToString()
    note = f"{method}({_short(request)})"
    damage = rng.random()
    if damage < 0.15:  # an unknown field: a hyperparameter this node does not know, or a path
        extra = unknown_field(rng, marker)
        if method == "SetHyperparameters" and rng.random() < 0.7:  # inside the overrides message
            inner = request.overrides.SerializeToString() + extra
            data = varint(1 << 3 | 2) + varint(len(inner)) + inner + (b"\x10\x01" if request.clear else b"")
        else:
            data += extra
        note += f" + unknown field {extra[:40]!r}"
    elif damage < 0.35:  # bytes flipped, cut or added
        mutable = bytearray(data)
        action = rng.randrange(3)
        if action == 0 and mutable:
            for _ in range(rng.randrange(1, 4)):
                mutable[rng.randrange(len(mutable))] ^= 1 << rng.randrange(8)
        elif action == 1:
            del mutable[rng.randrange(len(mutable) + 1) :]
        else:
            mutable += rng.randbytes(rng.randrange(1, 30))
        data = bytes(mutable)
        note += f" damaged to {data[:60]!r}"
    elif damage < 0.42:
        data = rng.randbytes(rng.choice((1, 3, 16, 200, 5000)))
        note = f"{method} with random bytes {data[:40]!r}"
    try:
        parsed = kind.FromString(data)
    except Exception:  # what the service cannot parse: INVALID_ARGUMENT
        parsed = None
    if parsed is not None and metadata == GOOD:
        # Nothing here undoes a drain or a shutdown: those are sent only where they must be refused.
        if method == "Shutdown" or (method == "Drain" and timeout_valid(parsed.timeout_seconds)):
            return None
        if method == "WatchSteps" and rng.random() < 0.7:
            return None  # each waits for its deadline: a few are enough
    return Call(method, data, parsed, metadata, note)


def _short(message: object) -> str:
    text = str(message).replace("\n", " ")
    return text if len(text) <= 120 else f"{text[:117]}..."


def timeout_valid(value: float) -> bool:
    return math.isfinite(value) and 0.0 <= value <= MAX_WAIT_S


def overrides_valid(values: dict[str, float]) -> bool:
    """What the node accepts as its operator's hyperparameter overrides (docs/operations.md)."""
    for name, value in values.items():
        if name.startswith("beta"):
            if not 0.0 <= value < 1.0:
                return False
        elif not (math.isfinite(value) and value >= 0.0):
            return False
    return "lr" not in values or "lr_scale" not in values or math.isfinite(values["lr"] * values["lr_scale"])


@dataclass(slots=True)
class State:
    """What the admin service shows: the stable part of GetStatus and the overrides."""

    status: tuple
    overrides: dict[str, float]


class AdminModel:
    """What each call must answer and what it must change."""

    def __init__(self, channel: grpc.Channel, checkpoint_dir: Path, node: WatchedNode) -> None:
        self.channel = channel
        self.stub = admin_pb2_grpc.OptimizerNodeAdminStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)
        self.checkpoint_dir = checkpoint_dir
        self.node = node
        self.phase = "between steps"
        self.codes: dict[str, int] = {}
        self.calls = 0
        self.last: State | None = None  # the state after the last call: only the fuzzer's calls change it

    def state(self) -> State:
        status = self.stub.GetStatus(admin_pb2.GetStatusRequest(), metadata=GOOD, timeout=10)
        overrides = self.stub.GetHyperparameters(admin_pb2.GetHyperparametersRequest(), metadata=GOOD, timeout=10).overrides
        stable = (
            status.registered,
            status.step,
            status.buckets_owned,
            status.bytes_owned,
            status.world_size,
            status.paused,
            status.pause_reason,
            status.data_address,
        )
        return State(stable, {f.name: v for f, v in overrides.ListFields()})

    def expect(self, call: Call, before: State) -> tuple[set[grpc.StatusCode], State]:
        """The statuses the call may get, and the state it leaves when it gets OK."""
        codes = grpc.StatusCode
        if call.method.startswith("/"):
            return {codes.UNIMPLEMENTED}, before
        if not call.authorized:
            return {codes.UNAUTHENTICATED}, before
        if call.request is None:
            return {codes.INVALID_ARGUMENT}, before
        request = call.request
        after = State(before.status, dict(before.overrides))
        if call.method == "SetHyperparameters":
            values = {} if request.clear else {k: v for k, v in before.overrides.items() if k != "max_grad_norm"}
            values.update({name: getattr(request.overrides, name) for name in HYPER_FIELDS if request.overrides.HasField(name)})
            clip = before.overrides.get("max_grad_norm") if not request.clear else None
            if request.overrides.HasField("max_grad_norm"):
                clip = request.overrides.max_grad_norm
                if not (math.isfinite(clip) and clip > 0):
                    return {codes.INVALID_ARGUMENT}, before
            if not overrides_valid(values):
                return {codes.INVALID_ARGUMENT}, before
            after.overrides = {**values, **({"max_grad_norm": clip} if clip is not None else {})}
            return {codes.OK}, after
        if call.method == "Pause":
            if len(request.reason) > MAX_REASON_CHARS or not request.reason.isprintable():
                return {codes.INVALID_ARGUMENT}, before
            status = list(before.status)
            status[5], status[6] = True, request.reason or "paused by the operator"
            after.status = tuple(status)
            return {codes.OK}, after
        if call.method == "Resume":
            status = list(before.status)
            status[5], status[6] = False, ""
            after.status = tuple(status)
            return {codes.OK}, after
        if call.method in ("Checkpoint", "Drain"):
            if not timeout_valid(request.timeout_seconds):
                return {codes.INVALID_ARGUMENT}, before
            # RESOURCE_EXHAUSTED: the waiting calls of the fuzzer's last moments hold every slot for waiting
            return ({codes.OK} if self.phase == "between steps" else {codes.DEADLINE_EXCEEDED}) | {codes.RESOURCE_EXHAUSTED}, before
        if call.method == "WatchSteps":  # no step completes during the fuzz: the stream waits out the call's deadline
            return {codes.DEADLINE_EXCEEDED, codes.RESOURCE_EXHAUSTED}, before
        return {codes.OK}, before

    def run(self, call: Call) -> None:
        before = self.last if self.last is not None else self.state()
        allowed, expected = self.expect(call, before)
        rpc = self.channel.unary_unary(call.path)  # identity serializers: the bytes go as they are
        started = time.monotonic()
        waits = call.method in ("WatchSteps", "Checkpoint", "Drain")  # until the call's deadline, where they wait at all
        try:
            response = rpc(call.data, metadata=call.metadata, timeout=0.5 if waits else CALL_TIMEOUT_S)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as error:
            code, details, response = error.code(), error.details() or "", None
        self.calls += 1
        self.codes[code.name] = self.codes.get(code.name, 0) + 1
        where = f"{call.note} with metadata {[(k, v[:30]) for k, v in call.metadata]}"
        assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), f"{code.name} ({details}) for {where}"
        assert code in allowed, f"{code.name} ({details}) for {where}; expected {sorted(c.name for c in allowed)}"
        assert time.monotonic() - started < CALL_TIMEOUT_S + 2, f"{where} took {time.monotonic() - started:.1f} s"
        after = self.last = self.state()
        if code == grpc.StatusCode.OK:
            assert after == expected, f"{where} left {after}, expected {expected}"
            if call.method == "Checkpoint":
                path = Path(admin_pb2.CheckpointResponse.FromString(response).path).resolve()
                assert path.is_relative_to(self.checkpoint_dir.resolve()), f"a checkpoint at {path}"
        else:
            assert after == before, f"the refused {where} ({code.name}) changed {before} into {after}"

    def healthy(self) -> None:
        reply = self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, reply
        assert self.node.alive(), self.node.health()


class Kicker:
    """ECHOs to the node every few milliseconds from a thread of its own. The daemon thread runs admin
    calls between two messages and otherwise waits up to 50 ms for one: with this traffic an admin
    call is answered in a few milliseconds and the fuzzer makes ten times the calls (and the data
    plane is busy while the admin plane is fuzzed)."""

    def __init__(self, context: zmq.Context, address: str) -> None:
        self._context, self._address = context, address
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kicker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self._address)
        echo = frames_of(Header(msg_type=MsgType.ECHO))
        while not self._stop.wait(0.004):
            socket.send_multipart(echo)
            while socket.poll(0):
                socket.recv_multipart()
        socket.close(0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def fuzz(model: AdminModel, rng: random.Random, seconds: float, marker: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        call = make_call(rng, marker, model.phase)
        if call is not None:
            model.run(call)
        if model.calls % 25 == 0:
            model.healthy()


def streams_and_waits_leave_health_checks_answered(model: AdminModel) -> None:
    """More WatchSteps streams (and, with a step in flight, waiting checkpoints) than the service
    serves at once: the extra ones get RESOURCE_EXHAUSTED at once, and health checks still answer."""
    outcomes: list[str] = []

    def watch() -> None:
        try:
            for _ in model.stub.WatchSteps(admin_pb2.WatchStepsRequest(), metadata=GOOD, timeout=1.5):
                pass
        except grpc.RpcError as error:
            outcomes.append(error.code().name)

    def wait_for_checkpoint() -> None:
        try:
            model.stub.Checkpoint(admin_pb2.CheckpointRequest(timeout_seconds=1.0), metadata=GOOD, timeout=1.5)
            outcomes.append("OK")
        except grpc.RpcError as error:
            outcomes.append(error.code().name)

    work: list[Callable[[], None]] = [watch] * (MAX_LONG_CALLS + 2)
    if model.phase == "in flight":
        work += [wait_for_checkpoint] * 4
    threads = [threading.Thread(target=target) for target in work]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    model.healthy()
    model.stub.GetStatus(admin_pb2.GetStatusRequest(), metadata=GOOD, timeout=5)
    for thread in threads:
        thread.join(10)
    assert len(outcomes) == len(work) and set(outcomes) <= {"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}, outcomes
    assert outcomes.count("RESOURCE_EXHAUSTED") >= len(work) - MAX_LONG_CALLS, outcomes


def escaped_files(marker: str, roots: list[Path]) -> list[Path]:
    found = []
    for root in roots:
        for directory, names, files in os.walk(root):
            found += [Path(directory) / name for name in names + files if marker in name]
            if root != roots[0]:
                names.clear()  # elsewhere only the top level: the fuzzer's paths are short
    return found


start_node = pytest.fixture(watched_nodes)


def test_fuzz_the_admin_service(tmp_path, start_node):
    seed = fuzz_seed()
    marker = escape_marker(seed)
    with seed_named_on_failure(seed):
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(0o600)
        checkpoints = tmp_path / "checkpoints"
        node = start_node("admin-fuzzed", ("--admin", "127.0.0.1:0", "--admin-token-file", str(token_file), "--checkpoint-dir", str(checkpoints)))
        context = zmq.Context()
        channel = grpc.insecure_channel(node.admin_address)
        try:
            # A two-rank job with values, between steps.
            rank0, rank1 = Line(context, node.address, "rank 0"), Line(context, node.address, "rank 1")
            generator = torch.Generator().manual_seed(seed % (1 << 30))
            initial = {b.bucket_id: torch.randn(b.numel, generator=generator) for b in JOB.plan()}
            job = JobModel(JOB, 0, initial)
            wire = WireFuzzer(node, job, 1 << 30)
            incarnations = [secrets.randbits(62) | 1 for _ in range(2)]

            def hello(rank: int) -> list[bytes]:
                return frames_of(Header(msg_type=MsgType.HELLO, rank=rank, meta={"job": JOB.to_wire(), "node_index": 0, "incarnation": incarnations[rank]}))

            send_accepted(wire, rank0, hello(0), "rank 0's HELLO")
            for bucket_id, values in initial.items():
                replies = rank0.exchange(frames_of(tensor_header(MsgType.INIT, values, rank=0, bucket_id=bucket_id), values))
                assert replies is not None and [r.header.msg_type for r in replies] == [MsgType.ACK], replies
            send_accepted(wire, rank1, hello(1), "rank 1's HELLO")

            model = AdminModel(channel, checkpoints, node)
            kicker = Kicker(context, node.address)
            model.healthy()
            fuzz(model, random.Random(f"{seed}:between steps"), fuzz_seconds() / 2, marker)
            streams_and_waits_leave_health_checks_answered(model)
            model.stub.Resume(admin_pb2.ResumeRequest(), metadata=GOOD, timeout=10)
            model.stub.SetHyperparameters(admin_pb2.SetHyperparametersRequest(clear=True), metadata=GOOD, timeout=10)
            model.last = None

            # A step in flight: rank 0's gradient of bucket 0 is in, rank 1's is awaited.
            grads = {(rank, b.bucket_id): torch.randn(b.numel, generator=generator) for rank in (0, 1) for b in JOB.plan()}

            def push(rank: int, bucket_id: int, step: int, line: Line) -> list[Reply]:
                grad = grads[(rank, bucket_id)] * (step + 1)
                header = tensor_header(MsgType.PUSH, grad, rank=rank, step=step, bucket_id=bucket_id, meta={"hyper": HYPER.to_wire()})
                return send_accepted(wire, line, frames_of(header, grad), f"rank {rank}'s push of bucket {bucket_id} step {step}")

            push(0, 0, 0, rank0)
            model.phase = "in flight"
            fuzz(model, random.Random(f"{seed}:in flight"), fuzz_seconds() / 2, marker)
            streams_and_waits_leave_health_checks_answered(model)
            kicker.stop()
            print(f"{model.calls} admin calls: {model.codes}; peak RSS +{node.peak_growth() >> 20} MiB")

            # The ranks finish the step and do one more: the overrides cleared, every value AdamW's.
            model.stub.Resume(admin_pb2.ResumeRequest(), metadata=GOOD, timeout=10)
            model.stub.SetHyperparameters(admin_pb2.SetHyperparametersRequest(clear=True), metadata=GOOD, timeout=10)
            for step in (0, 1):
                for bucket_id in job.buckets:
                    seen: dict[str, list[Reply]] = {rank0.name: [], rank1.name: []}
                    for rank, line in ((0, rank0), (1, rank1)):
                        if step == 0 and (rank, bucket_id) == (0, 0):
                            continue
                        seen[line.name] += push(rank, bucket_id, step, line)
                    assert job.step(bucket_id) == step + 1
                    for line in (rank0, rank1):  # both ranks have the new values before either pushes again
                        await_params(wire, line, bucket_id, step + 1, seen[line.name])
            model.healthy()
            assert node.peak_growth() <= RSS_GROWTH_BOUND, f"peak RSS +{node.peak_growth() >> 20} MiB"
            log = node.node.log_text()
            assert "Traceback" not in log, f"the node logged an exception:\n{log[log.index('Traceback') - 300 :][:3000]}"
            # Nothing written outside the checkpoint directory, whatever strings the calls carried.
            escaped = escaped_files(marker, [tmp_path, Path.cwd(), Path("/tmp"), Path.home()])
            assert not escaped, f"files named after the fuzzer's paths: {escaped}"
            for path in checkpoints.rglob("*"):
                assert path.resolve().is_relative_to(checkpoints.resolve()), f"{path} leads out of the checkpoint directory"
            assert {p.name for p in tmp_path.iterdir()} <= {"token", "checkpoints", "admin-fuzzed.log", "admin-fuzzed.ready.json"}
            for line in (rank0, rank1):
                line.close()
        finally:
            channel.close()
            context.destroy(linger=0)
            status = node.stop()
        assert status == 0, node.health()


# ---------------------------------------------------------------------------- what the fuzz found


@pytest.fixture(scope="module")
def admin_node(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("admin")
    nodes = watched_nodes(tmp_path)
    node = next(nodes)("admin", ("--admin", "127.0.0.1:0", "--checkpoint-dir", str(tmp_path / "checkpoints")))
    channel = grpc.insecure_channel(node.admin_address)
    yield node, channel, admin_pb2_grpc.OptimizerNodeAdminStub(channel)
    channel.close()
    assert node.stop() == 0, node.health()
    next(nodes, None)  # stops it, had it not stopped


@pytest.mark.parametrize("data", [b"\xff\xff\xff", b"\x0a\x05abc", b"\x08" + b"\xff" * 11], ids=["garbage", "short-string", "long-varint"])
def test_a_request_that_does_not_parse_is_invalid_not_internal(admin_node, data):
    _, channel, _ = admin_node
    for method in ("GetStatus", "Pause", "SetHyperparameters", "Checkpoint"):
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(SERVICE + method)(data, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value.details())


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0, 1e300])
def test_checkpoint_and_drain_refuse_timeouts_that_are_no_duration(admin_node, timeout):
    _, _, stub = admin_node
    for call in (
        lambda: stub.Checkpoint(admin_pb2.CheckpointRequest(timeout_seconds=timeout), timeout=10),
        lambda: stub.Drain(admin_pb2.DrainRequest(timeout_seconds=timeout), timeout=10),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_seconds" in info.value.details()


@pytest.mark.parametrize("text", ["line\nbreak", "x" * (MAX_REASON_CHARS + 1), "bidi\u202e"])
def test_a_pause_reason_is_one_printable_line(admin_node, text):
    _, _, stub = admin_node
    with pytest.raises(grpc.RpcError) as info:
        stub.Pause(admin_pb2.PauseRequest(reason=text), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=10).paused


def test_lr_times_lr_scale_must_be_a_number(admin_node):
    _, _, stub = admin_node
    with pytest.raises(grpc.RpcError) as info:
        stub.SetHyperparameters(admin_pb2.SetHyperparametersRequest(overrides=admin_pb2.Hyperparameters(lr=1e300, lr_scale=1e300)), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lr_scale" in info.value.details()


def test_streams_cannot_take_every_admin_thread(admin_node):
    """Before the bound, eight WatchSteps streams took the service's eight threads: every other call,
    health checks included, waited until one ended."""
    _, channel, stub = admin_node
    streams = [stub.WatchSteps(admin_pb2.WatchStepsRequest(), timeout=30) for _ in range(MAX_LONG_CALLS + 4)]
    time.sleep(1.0)
    started = time.monotonic()
    assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=5)
    assert time.monotonic() - started < 2
    refused = [s for s in streams if s.done() and s.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
    for stream in streams:
        stream.cancel()
    assert len(refused) == 4, [s.code() if s.done() else "open" for s in streams]
