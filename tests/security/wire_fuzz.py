"""The wire fuzzer's parts: lines to a node spoken to frame by frame, a model of what a node may
accept, with ``torch.optim.AdamW(fused=True)`` as the oracle of every parameter value it sends back,
and the loop that sends the bad messages of :mod:`tests.security.wire_mutations` and checks the answers.

What is checked for every message (see :meth:`WireFuzzer.send`):

* the node answers it (an ECHO sent behind it on the same connection comes back) and stays alive;
* every frame the node sends is a valid wire message; an ERROR has a documented code, never INTERNAL
  (an unhandled exception), and a bounded text; at most one ERROR per request;
* a message that :mod:`transport.wire` itself rejects (decoded here with the same functions) gets
  an ERROR with the same code (or TOO_LARGE / LIMIT, which the node checks first);
* the answer's type fits the request (STATUS for QUERY, the same payload for ECHO, ...);
* what the node accepted was acceptable: a gradient for the bucket's current step, from the
  connection registered as that rank, of the bucket's size and dtype, finite, with valid
  hyperparameters, not a duplicate; a HELLO_OK only for the registered job; no ACK, CLIP or
  node-to-worker message taken silently;
* every PARAMS holds, bit for bit, what AdamW gives from the accepted gradients.
"""

from __future__ import annotations

import copy
import itertools
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import zmq

from protos.job.hyper import AdamWHyper
from protos.job.placement import BucketSpec
from protos.job.spec import JobSpec
from tests.security.fuzzing import WatchedNode
from tests.security.wire_mutations import Draft, Template, answerable, header_bomb, is_int, mutate, pack, random_frames, routing_id, short
from transport.batches import split_batch
from transport.interface import Message
from transport.payload_views import payload_views
from transport.wire import (
    MAX_ERROR_CHARS,
    PROTOCOL_VERSION,
    WIRE_DTYPES,
    ErrorCode,
    Header,
    MsgType,
    WireError,
    decode_header,
    encode_message,
    tensor_header,
)

REPLY_TIMEOUT_S = 10.0
"""How long the node may take to answer the ECHO behind a fuzzed message (a 16 MiB header takes ~1.5 s)."""

ALLOWED_CODES = frozenset(ErrorCode) - {ErrorCode.INTERNAL}
"""What an ERROR may say: INTERNAL is documented, but it means the node met an exception it did not expect."""

NODE_TO_WORKER = frozenset(
    {MsgType.HELLO_OK, MsgType.ACK, MsgType.PARAMS, MsgType.NORM_PARTIAL, MsgType.STATUS, MsgType.ERROR, MsgType.NOTICE, MsgType.CONSUMED}
)
"""Message types only a node sends: a node must refuse each of them."""

ANSWERS: dict[MsgType, frozenset[MsgType]] = {
    MsgType.HELLO: frozenset({MsgType.HELLO_OK}),
    MsgType.INIT: frozenset({MsgType.ACK}),
    MsgType.PULL: frozenset({MsgType.PARAMS}),
    MsgType.QUERY: frozenset({MsgType.STATUS}),
    MsgType.ECHO: frozenset({MsgType.ECHO}),
    MsgType.BYE: frozenset({MsgType.ACK}),
}
"""Besides ERROR, and PARAMS and NOTICE, which a node may send at any time, the answers each request may get."""

ASYNC = frozenset({MsgType.PARAMS, MsgType.NOTICE})


class FuzzFailure(AssertionError):
    """A check failed; the message names the input."""


# ---------------------------------------------------------------------------- lines


@dataclass(slots=True)
class Reply:
    header: Header
    payload: torch.Tensor | None


def parse_reply(frames: Sequence[bytes], where: str) -> Reply:
    """A frame sequence the node sent, which must be a valid wire message."""
    try:
        header = decode_header(frames[0])
        views = payload_views(header, [memoryview(bytearray(f)) for f in frames[1:]], max_bytes=1 << 31)
    except (WireError, IndexError) as exc:
        raise FuzzFailure(f"the node sent {where} frames that are not a wire message ({exc}): {[bytes(f[:80]) for f in frames]}") from None
    payload = torch.cat([view for _, view in views]).clone() if views else None
    return Reply(header, payload)


def batch_parts(header: Header, payload: torch.Tensor | None) -> list[Reply]:
    """A batch (:mod:`transport.batches`) as one message per bucket; ``WireError`` if it does not split."""
    parts = split_batch(Message(peer=b"", header=header, tensors=[(0, payload)] if payload is not None else []))
    return [Reply(part.header, torch.cat([view for _, view in part.tensors]) if part.tensors else None) for part in parts]


def reply_parts(reply: Reply) -> list[Reply]:
    """The node's PARAMS batch as one reply per bucket; any other reply as it is."""
    if reply.header.msg_type != MsgType.PARAMS or "batch" not in reply.header.meta:
        return [reply]
    try:
        return batch_parts(reply.header, reply.payload)
    except WireError as exc:
        raise FuzzFailure(f"the node sent a PARAMS batch that does not split: {exc}") from None


class Line:
    """One DEALER connection to the node, spoken to frame by frame."""

    _markers = itertools.count(1 << 40)

    def __init__(self, context: zmq.Context, address: str, name: str, routing_id: bytes | None = None) -> None:
        self.name = name
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            self.socket.setsockopt(zmq.ROUTING_ID, routing_id)
        self.socket.connect(address)

    def send(self, frames: Sequence[bytes]) -> None:
        self.socket.send_multipart(list(frames))

    def recv(self, timeout_s: float) -> Reply | None:
        if not self.socket.poll(int(timeout_s * 1000)):
            return None
        return parse_reply(self.socket.recv_multipart(), f"to {self.name}")

    def drain(self) -> list[Reply]:
        """Whatever the node sent that is waiting here."""
        replies = []
        while (reply := self.recv(0.0)) is not None:
            replies.append(reply)
        return replies

    def exchange(self, frames: Sequence[bytes], timeout_s: float = REPLY_TIMEOUT_S) -> list[Reply] | None:
        """Send ``frames``, then an ECHO on the same connection; the replies that came before the
        ECHO's (a node handles one connection's messages in order), or ``None`` without an ECHO back."""
        self.send(frames)
        marker = next(Line._markers)
        probe = torch.tensor([1.0])
        self.send([bytes(f) for f in encode_message(tensor_header(MsgType.ECHO, probe, step=marker), probe)])
        replies: list[Reply] = []
        deadline = time.monotonic() + timeout_s
        while (reply := self.recv(max(deadline - time.monotonic(), 0.0))) is not None:
            if reply.header.msg_type == MsgType.ECHO and reply.header.step == marker:
                return replies
            replies.append(reply)
        return None

    def close(self) -> None:
        self.socket.close(0)


# ---------------------------------------------------------------------------- what a HELLO may register


def certainly_invalid_hello(header: Header) -> bool:
    """Whether a HELLO breaks a documented rule of the job spec (docs/wire-protocol.md,
    :meth:`JobSpec.validate`): conservative, ``False`` whenever it might register a job."""
    meta, job = header.meta, header.meta.get("job")
    if not isinstance(job, dict):
        return True
    required = ("world_size", "num_nodes", "bucket_numel", "wire_dtype", "max_grad_norm", "params")
    if any(key not in job for key in required):
        return True
    if any(not is_int(job[key]) or job[key] < 1 for key in required[:3]) or job["bucket_numel"] < 64:
        return True
    if not isinstance(job["wire_dtype"], str) or job["wire_dtype"] not in WIRE_DTYPES:
        return True
    norm = job["max_grad_norm"]
    if norm is not None and (not isinstance(norm, int | float) or not (math.isfinite(norm) and norm > 0)):
        return True
    params = job["params"]
    if not isinstance(params, list) or not params:
        return True
    names = set()
    for spec in params:
        if not isinstance(spec, list) or len(spec) != 4:
            return True
        name, shape, dtype, group = spec
        if not isinstance(name, str) or not isinstance(dtype, str) or not isinstance(group, int):
            return True
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            return True
        if name in names:
            return True
        names.add(name)
    mode, starts = job.get("mode", "full"), job.get("unit_starts", [])
    if not isinstance(mode, str) or mode not in ("full", "layerwise"):
        return True
    if not isinstance(starts, list) or not all(is_int(s) for s in starts):
        return True
    if starts != sorted(set(starts)) or any(not 0 <= s < len(params) for s in starts) or (starts and mode != "layerwise"):
        return True
    node_index, incarnation = meta.get("node_index"), meta.get("incarnation")
    if not isinstance(node_index, int) or not 0 <= node_index < job["num_nodes"]:
        return True
    if not is_int(incarnation) or not 0 < incarnation < 1 << 64:
        return True
    return not 0 <= header.rank < job["world_size"]


# ---------------------------------------------------------------------------- the model and its oracle


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that any NaN matches any NaN (their payload bits are no contract)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    kept_a, kept_b = a[~nan_a].contiguous(), b[~nan_b].contiguous()
    return torch.equal(kept_a.view(torch.int32), kept_b.view(torch.int32))


class Oracle:
    """``torch.optim.AdamW(fused=True)`` on one job's buckets, each parameter piece a tensor of its own
    (as the node updates them, see :mod:`protos.job.placement`), fed the rank-ordered sum of the
    accepted gradients divided by the world size."""

    def __init__(self, buckets: Iterable[BucketSpec], initial: dict[int, torch.Tensor]) -> None:
        self.buckets = {b.bucket_id: b for b in buckets}
        self.pieces = {b: [initial[b][s.bucket_offset : s.bucket_offset + s.numel].clone() for s in spec.segments] for b, spec in self.buckets.items()}
        self.optimizers = {b: torch.optim.AdamW(pieces, fused=True) for b, pieces in self.pieces.items()}
        self.steps = dict.fromkeys(self.buckets, 0)
        self.history: dict[tuple[int, int], torch.Tensor] = {(b, 0): initial[b].clone() for b in self.buckets}
        self.updates: dict[int, list[tuple[AdamWHyper, torch.Tensor]]] = {b: [] for b in self.buckets}  # what each update was fed

    def values(self, bucket_id: int) -> torch.Tensor:
        return torch.cat(self.pieces[bucket_id])

    def update(self, bucket_id: int, grads: Sequence[torch.Tensor], hyper: AdamWHyper, world_size: int) -> None:
        total = grads[0].clone()
        for grad in grads[1:]:
            total += grad
        average = total / world_size
        optimizer = self.optimizers[bucket_id]
        optimizer.param_groups[0].update(lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps, weight_decay=hyper.weight_decay)
        for piece, segment in zip(self.pieces[bucket_id], self.buckets[bucket_id].segments, strict=True):
            piece.grad = average[segment.bucket_offset : segment.bucket_offset + segment.numel].clone()
        optimizer.step()
        self.updates[bucket_id].append((hyper, average))
        self.steps[bucket_id] += 1
        self.history[(bucket_id, self.steps[bucket_id])] = self.values(bucket_id)


@dataclass(slots=True)
class PendingStep:
    grads: dict[int, torch.Tensor]
    hyper: AdamWHyper


class JobModel:
    """What a node serving one registered job may accept and must send: which line each rank is on,
    every bucket's step and the gradients it holds, and the oracle of its values."""

    def __init__(self, spec: JobSpec, node_index: int, initial: dict[int, torch.Tensor]) -> None:
        self.spec = spec
        self.node_index = node_index
        self.buckets = {b.bucket_id: b for b in spec.plan() if b.node == node_index}
        self.oracle = Oracle(self.buckets.values(), initial)
        self.rank_line: dict[int, str] = {}
        self.pending: dict[int, PendingStep] = {}
        self.accepted_pushes = 0

    def step(self, bucket_id: int) -> int:
        return self.oracle.steps[bucket_id]

    def hello_ok(self, line: str, header: Header) -> str | None:
        """A HELLO the node answered with HELLO_OK: the problem, or ``None`` (and ``line`` is now the rank)."""
        try:
            spec = JobSpec.from_wire(header.meta.get("job"))
        except ValueError as exc:
            return f"HELLO_OK for a job spec the job module rejects: {exc}"
        if spec != self.spec:
            return f"HELLO_OK for another job than the registered one: {spec} != {self.spec}"
        if header.meta.get("node_index") != self.node_index or not 0 <= header.rank < self.spec.world_size:
            return f"HELLO_OK for rank {header.rank}, node index {header.meta.get('node_index')!r}"
        self.rank_line[header.rank] = line
        return None

    def push_accepted(self, line: str, header: Header, grad: torch.Tensor) -> str | None:
        """A PUSH the node took without an error: the problem, or ``None`` (and the model takes it too)."""
        bucket = self.buckets.get(header.bucket_id)
        if self.rank_line.get(header.rank) != line:
            return f"a push as rank {header.rank} from {line}, which is not that rank's connection ({self.rank_line})"
        if bucket is None:
            return f"a push for bucket {header.bucket_id}, which this node does not own"
        if header.dtype != self.spec.wire_dtype or grad.numel() != bucket.numel:
            return f"a push of {grad.numel()} x {header.dtype} for bucket {bucket.bucket_id} of {bucket.numel} x {self.spec.wire_dtype}"
        if header.step != self.step(bucket.bucket_id):
            return f"a push for step {header.step} of bucket {bucket.bucket_id}, which is at step {self.step(bucket.bucket_id)}"
        if not bool(torch.isfinite(grad).all()):
            return f"a push with {int((~torch.isfinite(grad)).sum())} NaN/inf values (the node refuses them by default)"
        try:
            hyper = AdamWHyper.from_wire(header.meta.get("hyper"))
        except ValueError as exc:
            return f"a push with invalid hyperparameters: {exc}"
        pending = self.pending.get(bucket.bucket_id)
        if pending is None:
            pending = self.pending[bucket.bucket_id] = PendingStep({}, hyper)
        elif header.rank in pending.grads:
            return f"a second push of rank {header.rank} for bucket {bucket.bucket_id} step {header.step}"
        elif hyper != pending.hyper:
            return f"a push with hyperparameters {hyper}, another rank's push of that bucket and step had {pending.hyper}"
        pending.grads[header.rank] = grad.clone()
        self.accepted_pushes += 1
        if len(pending.grads) == self.spec.world_size:
            del self.pending[bucket.bucket_id]
            self.oracle.update(bucket.bucket_id, [pending.grads[r] for r in sorted(pending.grads)], pending.hyper, self.spec.world_size)
        return None

    def params(self, reply: Reply) -> str | None:
        """A PARAMS the node sent: the problem, or ``None`` when it holds AdamW's values of that step."""
        header = reply.header
        expected = self.oracle.history.get((header.bucket_id, header.step))
        if expected is None:
            return f"PARAMS for bucket {header.bucket_id} at step {header.step}, a step the model has not reached (steps {self.oracle.steps})"
        if reply.payload is None or not same_bits(reply.payload.to(torch.float32), expected):
            got = None if reply.payload is None else reply.payload[:4].tolist()
            fed = [(h, g[:3].tolist()) for h, g in self.oracle.updates[header.bucket_id][-3:]]
            return f"PARAMS for bucket {header.bucket_id} at step {header.step} differ from AdamW's: {got} != {expected[:4].tolist()} (last updates: {fed})"
        return None


# ---------------------------------------------------------------------------- the fuzzer


@dataclass(slots=True)
class Local:
    """What :mod:`transport.wire` makes of some frames, as the node's transport decodes them."""

    header: Header | None
    payload: torch.Tensor | None
    error: WireError | None


def decode_locally(frames: Sequence[bytes], max_bytes: int) -> Local:
    try:
        if not frames:
            raise WireError(ErrorCode.MALFORMED, "empty message")
        header = decode_header(frames[0])
        views = payload_views(header, [memoryview(bytearray(f)) for f in frames[1:]], max_bytes=max_bytes)
    except WireError as exc:
        return Local(None, None, exc)
    return Local(header, torch.cat([v for _, v in views]) if views else None, None)


@dataclass(slots=True)
class Tally:
    """What a fuzz loop sent and what came back."""

    sent: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1


class WireFuzzer:
    """Sends messages to a node one at a time and checks everything that comes back."""

    def __init__(self, node: WatchedNode, model: JobModel | None, max_message_bytes: int) -> None:
        self.node = node
        self.model = model
        self.max_message_bytes = max_message_bytes
        self.tally = Tally()

    def fail(self, problem: str, note: str) -> None:
        raise FuzzFailure(f"{problem}\n  input: {note}\n  {self.node.health() if not self.node.alive() else 'node still running'}")

    def send(self, line: Line, frames: list[bytes], note: str, timeout_s: float = REPLY_TIMEOUT_S, local: Local | None = None) -> list[Reply] | None:
        """Send one message and check the node's answer; ``None`` when the line got no answer within
        ``timeout_s`` (then the caller checks the node on another line)."""
        local = local if local is not None else decode_locally(frames, self.max_message_bytes)
        self.tally.sent += 1
        replies = line.exchange(frames, timeout_s)
        if replies is None:
            return None
        self.check(line, local, replies, note)
        return replies

    def check(self, line: Line, local: Local, replies: list[Reply], note: str) -> None:
        errors = [r for r in replies if r.header.msg_type == MsgType.ERROR]
        for reply in errors:
            self.check_error(reply, note)
        if local.header is not None and local.header.msg_type == MsgType.PUSH and "batch" in local.header.meta:
            self.check_batched_push(line, local, replies, errors, note)
            return
        if len(errors) > 1:
            self.fail(f"{len(errors)} ERRORs for one message: {[e.header.meta for e in errors]}", note)
        error = ErrorCode(errors[0].header.meta["code"]) if errors else None
        if error is not None:
            self.tally.count(self.tally.errors, error.name)
        if local.error is not None:
            if error is None:
                self.fail(f"no ERROR for a message the wire format rejects ({local.error})", note)
            elif error not in (local.error.code, ErrorCode.TOO_LARGE, ErrorCode.LIMIT):
                self.fail(f"ERROR {error.name} for a message the wire format rejects with {local.error}", note)
            self.check_replies(replies, frozenset(), note)
            return
        header = local.header
        assert header is not None
        if error is None:
            self.tally.count(self.tally.accepted, header.msg_type.name)
            self.accepted(line, header, local.payload, replies, note)  # the model first: PARAMS may already show the update
        self.check_replies(replies, ANSWERS.get(header.msg_type, frozenset()), note)

    def check_batched_push(self, line: Line, local: Local, replies: list[Reply], errors: list[Reply], note: str) -> None:
        """A batch of pushes is taken whole or refused whole (one ERROR), except that each bucket with a
        NaN/inf gradient is refused on its own (NON_FINITE naming it) and the others are taken."""
        assert local.header is not None
        for error in errors:
            self.tally.count(self.tally.errors, ErrorCode(error.header.meta["code"]).name)
        try:
            parts = batch_parts(local.header, local.payload)
        except WireError as exc:
            if len(errors) != 1:
                self.fail(f"{len(errors)} ERRORs for a batch that does not split ({exc})", note)
            self.check_replies(replies, frozenset(), note)
            return
        codes = [ErrorCode(error.header.meta["code"]) for error in errors]
        if any(code != ErrorCode.NON_FINITE for code in codes):
            if len(errors) > 1:
                self.fail(f"{len(errors)} ERRORs for one batch, not all NON_FINITE: {[e.header.meta for e in errors]}", note)
            self.check_replies(replies, frozenset(), note)  # refused whole: the model takes none of it
            return
        refused = [error.header.bucket_id for error in errors]
        for part in parts:
            if part.header.bucket_id in refused:
                if part.payload is None or bool(torch.isfinite(part.payload.to(torch.float32)).all()):
                    self.fail(f"NON_FINITE for bucket {part.header.bucket_id} of a batch, whose gradient is finite", note)
                continue
            self.tally.count(self.tally.accepted, "PUSH")
            self.accepted(line, part.header, part.payload, replies, note)
        self.check_replies(replies, ANSWERS.get(MsgType.PUSH, frozenset()), note)

    def check_error(self, reply: Reply, note: str) -> None:
        code, text = reply.header.meta.get("code"), reply.header.meta.get("message")
        if code not in ALLOWED_CODES:
            self.fail(f"ERROR with code {code!r} ({short(text)})", note)
        if not isinstance(text, str) or len(text) > MAX_ERROR_CHARS + 40:
            self.fail(f"ERROR {ErrorCode(code).name} with a text of {len(text) if isinstance(text, str) else type(text).__name__} characters", note)

    def accepted(self, line: Line, header: Header, payload: torch.Tensor | None, replies: list[Reply], note: str) -> None:
        """A message the node took without an ERROR: was it one it may take?"""
        kinds = [r.header.msg_type for r in replies]
        kind = header.msg_type
        if kind in NODE_TO_WORKER or kind == MsgType.CLIP:  # no job here clips: a CLIP is never expected
            self.fail(f"a {kind.name} taken without an error (a node must refuse it)", note)
        if kind in (MsgType.PUSH, MsgType.INIT, MsgType.PULL) and self.model is None:
            self.fail(f"{kind.name} taken without an error before any job is registered", note)
        if kind == MsgType.INIT and self.model is not None:
            self.fail("INIT of a bucket that already has values was acknowledged", note)
        if kind == MsgType.QUERY and kinds.count(MsgType.STATUS) != 1:
            self.fail(f"QUERY answered with {[k.name for k in kinds]}", note)
        if kind == MsgType.ECHO:
            echoes = [r for r in replies if r.header.msg_type == MsgType.ECHO]
            if len(echoes) != 1 or not _same_payload(echoes[0].payload, payload):
                got = [(r.header, None if r.payload is None else r.payload[:4].tolist()) for r in echoes]
                self.fail(f"ECHO not answered with the same payload: {got}, sent {None if payload is None else payload[:4].tolist()}", note)
        if kind == MsgType.HELLO:
            hello_ok = kinds.count(MsgType.HELLO_OK)
            if self.model is None and hello_ok:
                self.fail("a HELLO registered a job, though the test sends only HELLOs that cannot", note)
            if self.model is None and MsgType.NOTICE not in kinds:
                self.fail(f"a HELLO before rank 0's neither refused nor held (answered {[k.name for k in kinds]})", note)
            if self.model is not None and hello_ok != 1:
                self.fail(f"a HELLO to a registered job answered with {[k.name for k in kinds]}", note)
            if self.model is not None and (problem := self.model.hello_ok(line.name, header)) is not None:
                self.fail(problem, note)
        if kind == MsgType.PUSH and self.model is not None:
            grad = payload if payload is not None else torch.empty(0)
            if (problem := self.model.push_accepted(line.name, header, grad.to(torch.float32))) is not None:
                self.fail(f"the node accepted {problem}", note)
        if kind == MsgType.PULL and self.model is not None and MsgType.PARAMS not in kinds:
            at_step, bucket = header.meta.get("at_step"), header.bucket_id
            if not (is_int(at_step) and bucket in self.model.buckets and at_step == self.model.step(bucket) + 1):
                self.fail(f"a PULL (at_step {at_step!r}) neither answered nor refused", note)

    def check_replies(self, replies: list[Reply], answers: frozenset[MsgType], note: str) -> None:
        """Every reply is an ERROR, one of ``answers``, or what a node may send at any time; every
        PARAMS holds AdamW's values."""
        for reply in (part for whole in replies for part in reply_parts(whole)):
            kind = reply.header.msg_type
            if kind != MsgType.ERROR and kind not in answers and kind not in ASYNC:
                self.fail(f"the node answered with {kind.name} ({short(reply.header.meta)})", note)
            if kind == MsgType.PARAMS:
                if self.model is None:
                    self.fail(f"PARAMS without a job: {reply.header}", note)
                elif (problem := self.model.params(reply)) is not None:
                    self.fail(problem, note)

    def check_line(self, line: Line, note: str) -> list[Reply]:
        """Check what arrived on ``line`` out of turn (PARAMS of completed steps, NOTICEs); returns it."""
        replies = line.drain()
        for reply in replies:
            if reply.header.msg_type == MsgType.ERROR:
                self.check_error(reply, note)
        self.check_replies(replies, frozenset(), note)
        return replies


def frames_of(header: Header, payload: torch.Tensor | None = None) -> list[bytes]:
    return [bytes(f) for f in encode_message(header, payload)]


def send_accepted(fuzzer: WireFuzzer, line: Line, frames: list[bytes], what: str) -> list[Reply]:
    """A message of a good worker: answered, and without an error."""
    replies = fuzzer.send(line, frames, what)
    assert replies is not None, f"{what}: no answer; {fuzzer.node.health()}"
    errors = [r.header.meta for r in replies if r.header.msg_type == MsgType.ERROR]
    assert not errors, f"{what}: {errors}"
    return replies


def await_params(fuzzer: WireFuzzer, line: Line, bucket_id: int, step: int, seen: Sequence[Reply] = (), timeout_s: float = REPLY_TIMEOUT_S) -> None:
    """Wait until ``line`` got the PARAMS of ``bucket_id`` at ``step`` (checked, as everything that
    arrives meanwhile): a node applies an update once no message waits, so a good worker waits for its
    values before it pushes the next step's gradient."""
    if any(r.header.msg_type == MsgType.PARAMS and (r.header.bucket_id, r.header.step) == (bucket_id, step) for w in seen for r in reply_parts(w)):
        return
    deadline = time.monotonic() + timeout_s
    while (reply := line.recv(max(deadline - time.monotonic(), 0.0))) is not None:
        if reply.header.msg_type == MsgType.ERROR:
            fuzzer.check_error(reply, f"waiting for bucket {bucket_id} at step {step} on {line.name}")
        fuzzer.check_replies([reply], frozenset(), f"waiting for bucket {bucket_id} at step {step} on {line.name}")
        if any(r.header.msg_type == MsgType.PARAMS and (r.header.bucket_id, r.header.step) == (bucket_id, step) for r in reply_parts(reply)):
            return
    fuzzer.fail(f"no PARAMS of bucket {bucket_id} at step {step} within {timeout_s:.0f} s", f"waiting on {line.name}")


def _same_payload(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))


def run_loop(
    fuzzer: WireFuzzer,
    rng: random.Random,
    seconds: float,
    lines: Sequence[Line],
    templates: Sequence[Template],
    *,
    context: zmq.Context,
    aim: Callable[[Draft, Line], None] | None = None,
    veto: Callable[[Header], bool] | None = None,
    bombs: int = 0,
) -> None:
    """Fuzz for ``seconds``: mostly mutated ``templates`` (after ``aim`` pointed them at the node's
    current state), some random frames, some from connections with odd routing ids, and ``bombs``
    oversized headers. A message whose decoded header ``veto`` refuses is not sent."""
    deadline = time.monotonic() + seconds
    bomb_at = sorted(rng.uniform(0, seconds) for _ in range(bombs))
    started = time.monotonic()
    while time.monotonic() < deadline:
        line = rng.choice(lines)
        kind = rng.random()
        if bomb_at and time.monotonic() - started >= bomb_at[0]:
            bomb_at.pop(0)
            bomb, note = header_bomb(rng)
            frames, kind = [bomb], 1.0
        elif kind < 0.08:
            frames, note = random_frames(rng), "random frames"
        else:
            template = rng.choice(templates)
            if aim is not None:
                draft = Draft([(k, copy.deepcopy(v)) for k, v in template.fields], list(template.frames))
                aim(draft, line)
                template = Template(template.name, draft.fields, draft.frames)
            draft = mutate(template, rng, rng.choice((0, 1, 1, 1, 2, 3)) if aim is not None else rng.choice((1, 1, 2, 3)))
            frames, note = draft.encoded(), " / ".join(draft.notes)
        local = decode_locally(frames, fuzzer.max_message_bytes)
        if local.header is not None and (veto is not None and veto(local.header)):
            continue
        # a HELLO that may register goes on the test's lines only: the fuzzer keeps the ranks it can reach
        registers = local.header is not None and local.header.msg_type == MsgType.HELLO and not certainly_invalid_hello(local.header)
        note = f"{note} on {line.name}: {[bytes(f[:48]) for f in frames[:3]]}"
        if kind < 0.12 and not registers:
            # the same message from a connection of its own, with a routing id of the client's choosing
            chosen = routing_id(rng)
            odd = Line(context, fuzzer.node.address, f"routing id {chosen!r}", chosen)
            try:
                if answerable(chosen):
                    if fuzzer.send(odd, frames, note, local=local) is None:
                        fuzzer.fail(f"no answer within {REPLY_TIMEOUT_S:.0f} s to routing id {chosen!r}", note)
                else:  # the node's answers go to a routing id this socket does not have: nothing to wait for
                    odd.socket.setsockopt(zmq.LINGER, 1000)
                    odd.send(frames)
                    fuzzer.tally.sent += 1
            finally:
                odd.close()
            line, frames, note = lines[0], [pack({"v": PROTOCOL_VERSION, "t": int(MsgType.QUERY)})], f"QUERY after: {note}"
            local = decode_locally(frames, fuzzer.max_message_bytes)
        replies = fuzzer.send(line, frames, note, local=local)
        if replies is None:
            fuzzer.fail(f"no answer within {REPLY_TIMEOUT_S:.0f} s", note)
        if not fuzzer.node.alive():
            fuzzer.fail("the node died", note)
