"""What a node checks before it takes a job, and of every later message of it: a HELLO's job within
this node's limits and its share of it within the node's memory; a later HELLO against the
registered job; each message's bucket, dtype, size and payload. One :class:`JobAdmission` a job: the
payload limit it sets (the largest owned bucket) goes with the job.

A peer that is not a registered rank learns nothing about the job from these errors: a HELLO that
does not match says which field differs and the worker's own value, with a fingerprint of the
registered job; the node's log has the rest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging

from optimizer_node.config import NodeConfig
from optimizer_node.job_state import ActiveJob
from optimizer_node.log_limits import RateLimitedLog
from optimizer_node.moments.codec import bucket_state_bytes
from optimizer_node.state.memory_plan import STATE_BYTES_PER_PARAM, fit_problem, node_needs
from protos.job.placement import BucketSpec
from protos.job.spec import JobSpec, LimitError
from transport.batches import MAX_BATCH_BYTES
from transport.interface import Message, ServerEndpoint
from transport.shm.window import UNIT_BYTES
from transport.wire import WIRE_DTYPES, ErrorCode, Header, WireError

STATE_BYTES_PER_FP32 = 4
"""Bytes of an fp32 element: the widest a payload travels in (INIT is fp32)."""


def job_fingerprint(spec: JobSpec) -> str:
    """A short hash of a job's description: what a worker whose HELLO does not match is told about the
    registered job (and what the node logs beside it), enough to tell two jobs apart and no more."""
    canonical = json.dumps(spec.to_wire(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def _shown(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def public_mismatch(registered: JobSpec, theirs: JobSpec) -> str:
    """The first field where ``theirs`` differs from ``registered``, said with the worker's own value
    only: the registered value stays in the node's log (see :meth:`JobSpec.mismatch`)."""
    names = [spec_field.name for spec_field in dataclasses.fields(JobSpec)]
    for name in sorted(names, key=lambda name: name != "mode"):  # the mode first, as JobSpec.mismatch: it explains the rest
        mine, other = getattr(registered, name), getattr(theirs, name)
        if mine == other:
            continue
        if name == "bucket_numel":  # RemoteAdamW's default follows the model's size and the node count
            return (
                f"bucket_numel differs (this worker has {_shown(other)}): give every rank the bucket_numel the job was registered with "
                "(this node's log says which)"
            )
        if name != "params":
            return f"{name} differs (this worker has {_shown(other)})"
        for index, (want, have) in enumerate(zip(mine, other, strict=False)):
            if want != have:
                return f"parameter {index} differs (this worker has {have.name!r} shape {list(have.shape)} {have.dtype} group {have.group})"
        return f"the number of parameters differs (this worker has {len(other)})"
    return "the job differs"


class JobAdmission:
    """The checks of one job's node: what a HELLO may declare, whether this node can hold its share,
    whether a later HELLO describes the registered job, and each message's bucket, dtype and size.

    ``endpoint``: told the payload limit and the size of same-host gradient windows once a job is
    registered; ``limit_log``: the node's rate-limited log, for what peers can repeat at will."""

    def __init__(self, config: NodeConfig, node_id: str, endpoint: ServerEndpoint, limit_log: RateLimitedLog) -> None:
        self._config = config
        self._node_id = node_id
        self._endpoint = endpoint
        self._limit_log = limit_log
        self.payload_limit = config.max_message_bytes  # bytes: lowered to the largest bucket once a job is registered
        self.payload_why = f"this node's limit of {config.max_message_bytes} bytes (--max-message-bytes)"  # for the TOO_LARGE reply

    def parse_hello(self, message: Message) -> tuple[JobSpec, int, int]:
        """The job, node index and incarnation a HELLO declares. Checked against this node's limits
        (LIMIT, naming the flag that raises the one exceeded) before anything proportional to the
        sizes it declares is made or iterated; BAD_REQUEST for what no job can have."""
        header = message.header
        if header.numel or header.num_chunks or message.tensors:
            raise WireError(ErrorCode.BAD_REQUEST, "bad HELLO: a HELLO carries no tensor payload")
        limits = self._config.job_limits()
        try:
            spec = JobSpec.from_wire(header.meta.get("job"), limits)
            spec.check_limits(limits)  # duplicate names, a bucket size below the split alignment, sizes over the limits
            node_index = header.meta.get("node_index")
            if not isinstance(node_index, int) or not 0 <= node_index < spec.num_nodes:
                raise ValueError(f"node_index {node_index!r} is not in [0, {spec.num_nodes})")
            if not 0 <= header.rank < spec.world_size:
                raise ValueError(f"rank {header.rank} is not in [0, {spec.world_size})")
            incarnation = header.meta.get("incarnation")
            if not isinstance(incarnation, int) or isinstance(incarnation, bool) or not 0 < incarnation < 1 << 64:
                raise ValueError(f"incarnation must be a positive 64-bit integer naming the worker process, got {incarnation!r}")
        except LimitError as exc:
            raise WireError(ErrorCode.LIMIT, f"node {self._node_id} refuses the job: {exc}") from None
        except ValueError as exc:
            raise WireError(ErrorCode.BAD_REQUEST, f"bad HELLO: {exc}") from None
        return spec, node_index, incarnation

    def plan_job(self, spec: JobSpec) -> list[BucketSpec]:
        """The bucket plan of a job rank 0 registers (its size bounded by :meth:`parse_hello`'s
        checks): LIMIT for more buckets than this node takes, or a bucket larger than a message may
        be (rank 0 could not send its initial values); BAD_REQUEST for a plan no job can have."""
        try:
            plan = spec.plan_within(self._config.job_limits())
        except LimitError as exc:
            raise WireError(ErrorCode.LIMIT, f"node {self._node_id} refuses the job: {exc}") from None
        except ValueError as exc:
            raise WireError(ErrorCode.BAD_REQUEST, f"bad HELLO: {exc}") from None
        largest = STATE_BYTES_PER_FP32 * max((bucket.numel for bucket in plan), default=0)
        if largest > self._config.max_message_bytes:
            error = LimitError(
                f"the job's largest bucket is {largest} bytes as fp32 (rank 0's initial values), over this node's limit of "
                f"{self._config.max_message_bytes} bytes per message",
                "--max-message-bytes",
            )
            raise WireError(ErrorCode.LIMIT, f"node {self._node_id} refuses the job: {error}")
        return plan

    def fit_problem(self, spec: JobSpec, node_index: int, plan: list[BucketSpec]) -> str | None:
        """Why this node cannot hold its share of the job (memory, disk), or ``None``."""
        mine = [b for b in plan if b.node == node_index]
        params = sum(b.numel for b in mine)
        sizes = [bucket_state_bytes(spec, bucket) for bucket in mine]  # the moments as the job stores them
        needs = node_needs(
            params,
            workers=spec.world_size,
            wire_bytes=WIRE_DTYPES[spec.wire_dtype].itemsize,
            layerwise=spec.mode == "layerwise",
            state_bytes=sum(sizes),
        )
        return fit_problem(
            needs,
            state_dir=self._config.state_dir,
            memory_budget=self._config.memory_budget,
            bucket_bytes=max(sizes, default=STATE_BYTES_PER_PARAM * spec.bucket_numel),
            num_nodes=spec.num_nodes,
        )

    def check_same_job(self, job: ActiveJob, spec: JobSpec, node_index: int, rank: int, *, finished: bool) -> None:
        """LAYOUT_MISMATCH unless the HELLO describes the registered job and this node's place in it.
        The worker is told the field and its own value; the registered layout goes to the log only.
        ``finished``: the registered job is over (the worker is told how the node takes another)."""
        difference = job.spec.mismatch(spec)
        if difference is None and node_index == job.node_index:
            return
        registered = job_fingerprint(job.spec)
        if difference is None:
            self._limit_log.log(
                "layout-mismatch", logging.WARNING, "rank %d addressed this node (node %d of job %s) as node %d", rank, job.node_index, registered, node_index
            )
            told = f"the worker addressed this node as node {node_index}, which is not its place in the registered job: give every worker the node addresses in the same order"
        else:
            self._limit_log.log("layout-mismatch", logging.WARNING, "rank %d's HELLO does not match the registered job %s: %s", rank, registered, difference)
            told = public_mismatch(job.spec, spec)
        if finished:
            told += "; the registered job is finished, and this node takes another only after `netoptim admin reset` (it runs with --next-job refuse)"
        raise WireError(
            ErrorCode.LAYOUT_MISMATCH,
            f"rank {rank} does not match the job registered here (fingerprint {registered}; this worker's job: {job_fingerprint(spec)}): {told}",
        )

    def limit_payloads(self, job: ActiveJob) -> None:
        """From now on no message may carry more than this node's largest bucket as fp32: refused with
        TOO_LARGE before its payload is viewed (by the endpoint, or by :meth:`check_payload_size`)."""
        bucket_bytes = STATE_BYTES_PER_FP32 * max((bucket.numel for bucket in job.owned.values()), default=0)
        largest = max(bucket_bytes, MAX_BATCH_BYTES)  # small buckets travel in batches (transport.batches)
        why = f"this node's limit since the job was registered: its largest bucket here as fp32 or a batch of small ones, {largest} bytes"
        if largest < self.payload_limit:
            self.payload_limit, self.payload_why = largest, why
        self._endpoint.limit_payload(largest, why)

    def size_gradient_windows(self, job: ActiveJob) -> None:
        """Same-host workers that connect from now on get a window for their gradients that holds a whole
        step of what each pushes here (this node's buckets in the wire dtype): a worker then gathers each
        bucket straight into it, on a GPU with one device-to-host copy, and the node reads it there.
        Out of core as well: the memory plan counts a step of gradients either way, and those that go
        on the socket instead cost the node a copy on ZeroMQ's one I/O thread (a 256M-parameter job,
        3 GiB of state through a 1 GiB budget, took 1.36x the time a step on the development machine). With
        --no-same-host-gradient-window the window keeps --same-host-window-mb."""
        if not self._config.same_host_gradient_window:
            return
        wire_bytes = WIRE_DTYPES[job.spec.wire_dtype].itemsize
        step_bytes = sum(-(-bucket.numel * wire_bytes // UNIT_BYTES) * UNIT_BYTES for bucket in job.owned.values())
        self._endpoint.size_inboxes(step_bytes)

    def check_payload_size(self, header: Header) -> None:
        """TOO_LARGE for a payload over the node's limit, for backends whose endpoint does not check it."""
        if header.payload_bytes > self.payload_limit:
            raise WireError(ErrorCode.TOO_LARGE, f"payload of {header.payload_bytes} bytes is over {self.payload_why}")

    def owned_bucket(self, job: ActiveJob, header: Header) -> BucketSpec:
        """The bucket a message names, if this node owns it (UNKNOWN_BUCKET otherwise)."""
        spec = job.owned.get(header.bucket_id)
        if spec is None:
            raise WireError(ErrorCode.UNKNOWN_BUCKET, f"bucket {header.bucket_id} is not owned by node {job.node_index} ({self._node_id})")
        return spec

    @staticmethod
    def check_payload(header: Header, bucket: BucketSpec, dtype: str) -> None:
        """WRONG_DTYPE or WRONG_SHAPE unless the payload is the bucket's, in ``dtype``."""
        if header.dtype != dtype:
            raise WireError(ErrorCode.WRONG_DTYPE, f"bucket {bucket.bucket_id} travels as {dtype}, got {header.dtype or 'no payload'}")
        if header.numel != bucket.numel:
            raise WireError(ErrorCode.WRONG_SHAPE, f"bucket {bucket.bucket_id} has {bucket.numel} elements, got {header.numel}")
