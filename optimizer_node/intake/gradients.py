"""Gradients into a node: each PUSH checked completely before it touches any state, then added to
its bucket's step in flight.

:class:`GradientIntake` owns one job's steps in flight (bucket -> :class:`BucketStep`: the
hyperparameters the ranks sent, the ordered sum of what came, the NaN/inf found) and the checks a
push must pass: a registered rank, an owned bucket, the payload's size and dtype, the bucket's step,
the same hyperparameters as the other ranks, no duplicate, no new gradient while the step's gradient
norm is awaited or while the node drains. A rejected push leaves the node exactly as it was. NaN/inf
is refused (``--non-finite refuse``: the pushing rank is told, and the job's other ranks, which wait
for the bucket) or taken for the step's global round to skip (``--non-finite skip``). Once every
rank's gradient of a bucket is in, ``complete`` is told (the job's round gate): it queues the update, or
the global round first. One a job, called on the node's thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from optimizer_node.intake.non_finite import count_non_finite
from optimizer_node.job_state import BucketStep
from optimizer_node.update.adamw import AdamWHyper
from optimizer_node.update.bucket_update import absent_segments
from optimizer_node.update.reduce import OrderedReduction
from protos.job.hyper import validate_for_rule
from transport.batches import split_batch
from transport.wire import ErrorCode, Header, MsgType, WireError, error_header

if TYPE_CHECKING:
    from optimizer_node.admin.overrides import OperatorOverrides
    from optimizer_node.config import NodeConfig
    from optimizer_node.control import StepClock
    from optimizer_node.faults import CrashPoints
    from optimizer_node.intake.admission import JobAdmission
    from optimizer_node.intake.morphing import MorphGate
    from optimizer_node.intake.non_finite import NonFiniteStats
    from optimizer_node.intake.rank_check import RankCheck
    from optimizer_node.job_state import ActiveJob, CurrentJob
    from optimizer_node.metrics import NodeMetrics
    from optimizer_node.state.persistence import Checkpoints
    from optimizer_node.state.storage import BucketState, BucketStore
    from optimizer_node.update.bucket_apply import BucketApply
    from optimizer_node.update.clipping import GlobalNormRound
    from protos.job.placement import BucketSpec
    from transport.interface import Message

log = logging.getLogger(__name__)


class IntakeParts(NamedTuple):
    """The parts of the job (and the node's) that taking a push reads and changes."""

    current: CurrentJob
    ranks: RankCheck
    admission: JobAdmission
    store: BucketStore
    overrides: OperatorOverrides
    norm_round: GlobalNormRound
    checkpoints: Checkpoints
    morphs: MorphGate
    bucket_apply: BucketApply
    crash_points: CrashPoints
    config: NodeConfig
    non_finite: NonFiniteStats  # node-wide: the counts outlive a job
    metrics: NodeMetrics
    clock: StepClock


class _PushCheck(NamedTuple):
    """What checking a push found, for taking it."""

    job: ActiveJob
    bucket: BucketSpec
    state: BucketState
    absent: frozenset[int]
    in_flight: BucketStep


class GradientIntake:
    """One job's gradients in: the steps in flight (``parts.current.in_flight``) and the checks every
    push passes first. ``send``: how a message goes out; ``complete``: told that every rank's gradient
    of a bucket's step is in."""

    def __init__(self, parts: IntakeParts, *, send: Callable[[bytes, Header], None], complete: Callable[[ActiveJob, int, int], None]) -> None:
        self._parts = parts
        self._send = send
        self._complete = complete
        self._worker_checks = parts.config.non_finite_check == "worker"
        self.in_flight: dict[int, BucketStep] = parts.current.in_flight  # bucket -> its step's gradients, until its update is applied
        self._hyper_parsed: tuple[object, AdamWHyper] | None = None  # the last hyperparameters parsed, as they came

    def on_push(self, message: Message) -> None:
        """A PUSH of one bucket: checked, then taken."""
        self._take(message, self._check(message))

    def on_batched_push(self, message: Message) -> None:
        """A batch of pushes (:mod:`transport.batches`) is checked whole before any of it is taken: one
        ERROR (naming the first bucket at fault) and nothing taken, or every bucket taken. Only a
        NaN/inf gradient refuses its own bucket, as a push of it alone would be."""
        self._parts.admission.check_payload_size(message.header)
        parts = split_batch(message)
        checked = [self._check(part) for part in parts]
        checking = time.perf_counter()
        whole_finite = count_non_finite(message.tensors) == 0  # one pass; bucket by bucket only if something is not finite
        self._parts.clock.current.reduce_s += time.perf_counter() - checking
        for part, check in zip(parts, checked, strict=True):
            self._take(part, check, known_finite=whole_finite)

    def drop_all(self) -> int:
        """Forget every step in flight (the job changes its width); returns the gradients dropped."""
        dropped = sum(len(in_flight.reduction.received) for in_flight in self.in_flight.values())
        self.in_flight.clear()
        return dropped

    def missing(self) -> list[list]:
        """[bucket, step, ranks whose gradient is not in] for each bucket still waiting, for QUERY."""
        return [[b, s.step, s.reduction.missing()] for b, s in sorted(self.in_flight.items()) if not s.reduction.complete]

    def _check(self, message: Message) -> _PushCheck:
        """Everything a push must pass before it is taken; ``WireError`` otherwise, nothing changed."""
        parts = self._parts
        job = parts.ranks.require_rank(message)
        header = message.header
        bucket = parts.admission.owned_bucket(job, header)
        absent = absent_segments(header.meta, bucket, header.numel)
        if header.numel or not absent:  # an empty push (no gradient for any segment) has no payload to check
            parts.admission.check_payload(header, bucket, job.spec.wire_dtype)
        state = parts.store.get(bucket.bucket_id)
        if state is None:
            raise WireError(ErrorCode.NOT_REGISTERED, f"bucket {bucket.bucket_id} has no initial values yet")
        if header.step < state.step:
            raise WireError(ErrorCode.STALE_STEP, f"bucket {bucket.bucket_id} is at step {state.step}; a gradient for step {header.step} is stale")
        if header.step > state.step:
            raise WireError(ErrorCode.FUTURE_STEP, f"bucket {bucket.bucket_id} is at step {state.step}; step {header.step} is in the future")
        hyper = self._hyper_of(header.meta.get("hyper"))
        in_flight = self.in_flight.get(bucket.bucket_id)
        if in_flight is None:
            try:  # once per bucket and step (later pushes must send the same): with the overrides (lr x lr_scale) too
                validate_for_rule(job.spec.rule, parts.overrides.apply(hyper))
            except ValueError as exc:
                raise WireError(ErrorCode.BAD_REQUEST, f"with this node's hyperparameter overrides: {exc}; see netoptim admin get-hparams") from None
            # defer: the last arrival's gradient is added in the update pass, together with AdamW
            reduction = OrderedReduction(state.numel, job.spec.world_size, state.reduction_buffer, defer=True)
            in_flight = BucketStep(header.step, hyper, reduction, time.perf_counter())
            parts.store.prefetch(bucket.bucket_id)  # out of core: read the state while the other ranks' gradients arrive
        elif header.rank in in_flight.reduction.received:
            raise WireError(ErrorCode.DUPLICATE, f"rank {header.rank} already pushed bucket {bucket.bucket_id} for step {header.step}")
        elif hyper != in_flight.hyper:
            raise WireError(
                ErrorCode.BAD_REQUEST, f"rank {header.rank} sent hyperparameters {hyper} for bucket {bucket.bucket_id}, another rank sent {in_flight.hyper}"
            )
        if parts.norm_round.awaiting is not None:
            raise WireError(ErrorCode.BAD_REQUEST, f"step {parts.norm_round.awaiting} waits for its gradient norm; no new gradients until it is applied")
        drain_step = parts.checkpoints.drain_step
        if drain_step is not None and header.step >= drain_step:
            raise WireError(ErrorCode.DRAINING, f"the node is draining: it finished step {drain_step} and takes no gradients after it")
        return _PushCheck(job, bucket, state, absent, in_flight)

    def _hyper_of(self, raw_hyper: object) -> AdamWHyper:
        """The hyperparameters a push sent, parsed; the buckets of one batch share one list, parsed once."""
        parsed = self._hyper_parsed
        if parsed is not None and raw_hyper is not None and raw_hyper is parsed[0]:
            return parsed[1]
        try:
            hyper = AdamWHyper.from_wire(raw_hyper)
        except ValueError as exc:
            raise WireError(ErrorCode.BAD_REQUEST, str(exc)) from None
        self._hyper_parsed = (raw_hyper, hyper)
        return hyper

    def _take(self, message: Message, check: _PushCheck, *, known_finite: bool = False) -> None:
        """Take a checked push: refused only for NaN/inf (``--non-finite refuse``), else added."""
        job, bucket, state, absent, in_flight = check
        parts, header = self._parts, message.header
        parts.morphs.push_taken()
        # NaN/inf, before the gradient touches any state: on the worker's word, else counted here (non_finite.py).
        checking = time.perf_counter()
        vouched = not known_finite and self._worker_checks and header.meta.get("finite") is True
        if vouched:  # the worker summed this gradient (on its device, or as it gathered it) and found it finite (--non-finite-check worker)
            parts.non_finite.vouched()
        non_finite = 0 if known_finite or vouched else count_non_finite(message.tensors)
        timings = parts.clock.current
        timings.reduce_s += time.perf_counter() - checking
        if non_finite and parts.config.non_finite == "refuse":
            self._refuse_non_finite(message.peer, header, non_finite)
            return
        if non_finite:  # skip policy: taken, and the step's global round will skip it everywhere
            in_flight.non_finite[header.rank] = non_finite
            log.warning(
                "rank %d's gradient of bucket %d at step %d holds %d NaN/inf value(s): the step will be skipped on every node (--non-finite skip)",
                header.rank,
                bucket.bucket_id,
                header.step,
                non_finite,
            )
        # Everything is validated: from here on the push is accepted.
        ledger = parts.current.ledger
        ledger.gradient_of_step(header.step)
        parts.clock.gradient_arrived()
        self.in_flight[bucket.bucket_id] = in_flight
        in_flight.absent = absent if in_flight.absent is None else in_flight.absent & absent
        started = time.perf_counter()
        in_flight.reduction.add(header.rank, message.tensors)
        timings.reduce_s += time.perf_counter() - started
        parts.crash_points.passed("push")
        if not in_flight.reduction.complete:
            if len(in_flight.reduction.received) == 1 and parts.bucket_apply.retain_previous and job.spec.wire_dtype == "float32":
                # Keep the values a restarted rank would need now, while the other ranks' gradients are
                # on their way, rather than on the path from the last gradient to the new values: where
                # a board of two slots a bucket holds them, there (the update writes the other slot).
                if not parts.bucket_apply.kept_on_board(job, state, ledger):
                    ledger.retain(bucket.bucket_id, state.step, state.param, torch.float32)
            return
        self._complete(job, bucket.bucket_id, header.step)

    def _refuse_non_finite(self, peer: bytes, header: Header, values: int) -> None:
        """The refuse policy: answer the push with NON_FINITE and tell the job's other ranks, which
        wait for this bucket. Nothing of the bucket changed; the rank may push it again for this step."""
        parts = self._parts
        bucket_id, step, rank = header.bucket_id, header.step, header.rank
        text = (
            f"rank {rank}'s gradient of bucket {bucket_id} at step {step} holds {values} NaN/inf value(s) of {header.numel}: refused "
            f"(--non-finite refuse). The node's state is unchanged and it keeps the other ranks' gradients of this bucket; push it again with "
            f"finite values to go on. To avoid it: lower the learning rate, clip gradients, use a GradScaler, or run the nodes with --non-finite skip"
        )
        log.warning("refused %s", text.partition(": refused")[0])
        parts.non_finite.refused(step, rank, bucket_id, values)
        parts.metrics.rejected_message()
        error = error_header(ErrorCode.NON_FINITE, text, bucket_id=bucket_id, step=step)
        error.meta.update({"rank": rank, "values": values})
        self._send(peer, error)
        notice = {"non_finite": {"rank": rank, "bucket": bucket_id, "step": step, "values": values}}
        for other in parts.current.ledger.connections():
            if other != peer:
                self._send(other, Header(msg_type=MsgType.NOTICE, bucket_id=bucket_id, step=step, meta=notice))
