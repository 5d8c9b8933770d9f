"""Applying one bucket's update on the node's thread, from its complete gradients to its new values.

:class:`BucketApply` owns that path for one job: it waits for the bucket's previous values to be
out, holds the bucket in the store while it changes, keeps the values a restarted rank may need to
redo its gradient (on the parameter board's other slot where there is one, else a copy the update
pass makes as it reads them), runs the one pass (:func:`~optimizer_node.update.bucket_update.update_bucket`:
the last gradient summed in, the rule, the cast onto the board or the outgoing copy) on the path the
job's first updates chose, and times it. Where the new values go is the daemon's: it hands
:meth:`BucketApply.apply` a ``deliver`` callback, run while the bucket is still held, since an
out-of-core bucket's tensors go back to the store's pool once released.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from optimizer_node.update.bucket_update import Applied, update_bucket
from transport.wire import WIRE_DTYPES

if TYPE_CHECKING:
    from collections.abc import Callable

    from optimizer_node.admin.overrides import OperatorOverrides
    from optimizer_node.config import NodeConfig
    from optimizer_node.control import StepClock
    from optimizer_node.intake.step_ledger import StepLedger
    from optimizer_node.job_state import ActiveJob, BucketStep
    from optimizer_node.serving.replies import ParameterReplies
    from optimizer_node.state.storage import BucketState, BucketStore
    from optimizer_node.update.path_choice import UpdatePathChoice
    from protos.job.hyper import AdamWHyper

    # the new values out, while the bucket is held: (job, state at its new step, its gradients, whether nothing changed)
    Deliver = Callable[[ActiveJob, BucketState, BucketStep, bool], None]


@dataclass(slots=True, eq=False)
class PendingUpdate:
    """One bucket's update between :meth:`BucketApply.begin` and :meth:`BucketApply.finish`."""

    job: ActiveJob
    state: BucketState
    in_flight: BucketStep
    ledger: StepLedger
    hyper: AdamWHyper  # with the operator's overrides
    arguments: dict[str, Any]  # update_bucket's keyword arguments
    board: torch.Tensor | None  # the bucket's slot on the parameter board the pass writes
    wire: torch.Tensor | None  # where the pass writes the new values in the wire dtype (the board, or the wire copy)
    masters_to_board: bool  # fp32 in memory: the board slot becomes the bucket's master values
    previous: torch.Tensor | None  # where the pass copies the values it replaces, for a restarted rank
    unchanged: bool  # no segment had a gradient on any rank
    bookkeeping_s: float = 0.0
    pass_s: float = 0.0
    applied: Applied | None = None  # set by the pass


class BucketApply:
    """One job's bucket updates: the values kept for a restarted rank, the pass, its timings.

    ``retain_previous``: whether the node keeps a bucket's values of the step in flight for a rank
    that restarts in it (an out-of-core node does not: it would need its memory budget again)."""

    def __init__(
        self,
        config: NodeConfig,
        store: BucketStore,
        replies: ParameterReplies,
        overrides: OperatorOverrides,
        update_paths: UpdatePathChoice,
        clock: StepClock,
        *,
        retain_previous: bool,
    ) -> None:
        self._config = config
        self._store = store
        self._replies = replies
        self._overrides = overrides
        self._update_paths = update_paths
        self._clock = clock
        self.retain_previous = retain_previous

    def kept_on_board(self, job: ActiveJob, state: BucketState, ledger: StepLedger) -> bool:
        """Keep the bucket's values of its step for a restarted rank where a board of two slots a bucket
        holds them (a view; the update writes the other slot); False where it does not (keep a copy)."""
        on_board = self._replies.board_values(job, state, state.step)
        if on_board is None:
            return False
        if ledger.may_need(state.bucket_id, state.step):
            ledger.keep(state.bucket_id, state.step, on_board, owned=False)
        return True

    def apply(self, job: ActiveJob, state: BucketState, in_flight: BucketStep, ledger: StepLedger, deliver: Deliver) -> None:
        """Update ``state`` with its complete gradients ``in_flight`` and ``deliver`` the new values
        while the bucket is held, all on this thread. ``StorageError`` from the store leaves everything
        as it was."""
        pending = self.begin(job, state, in_flight, ledger)
        error: BaseException | None = None
        try:
            self.run(pending)
        except BaseException as exc:
            error = exc
        self.finish(pending, error, deliver)

    def begin(self, job: ActiveJob, state: BucketState, in_flight: BucketStep, ledger: StepLedger) -> PendingUpdate:
        """Everything before the pass, on the loop's thread: the previous values out, the bucket held,
        the values a restarted rank may need kept, the pass's arguments. ``StorageError`` from the
        store leaves everything as it was. :meth:`run` the pass next (on any thread), then :meth:`finish`."""
        if self._replies.outbox.waits_for(state.bucket_id):  # the update overwrites the values the batch would send
            self._replies.flush()
        for handle in state.pending_sends:  # the previous step's values may still be on their way out
            handle.wait(self._config.send_timeout_s)
        state.pending_sends.clear()
        self._store.acquire(state)  # StorageError here leaves everything as it was
        try:
            return self._prepare(job, state, in_flight, ledger)
        except BaseException:
            self._store.release(state, dirty=False)
            raise

    def _prepare(self, job: ActiveJob, state: BucketState, in_flight: BucketStep, ledger: StepLedger) -> PendingUpdate:
        started = time.perf_counter()
        # the update pass writes the values onto the parameter board too (a 16-bit wire: its cast, which
        # it makes anyway), into the bucket's slot that does not hold this step's values: they stay there
        board = self._replies.board_slot(job, state)
        # fp32 in memory: the board's slot is where the new master values go, the pass reading the
        # current ones (on the other slot after the first update) and writing each value once
        masters_to_board = board is not None and self._config.masters_on_board and self._store.params_movable and job.spec.wire_dtype == "float32"
        if board is None:
            state.own_param()  # updated in place, not in a slot workers may read
        previous = None
        if self.retain_previous and ledger.retained(state.bucket_id, state.step) is None:
            # a rank that restarts in this step needs them to redo its gradient
            if state.wire_copy is not None and state.wire_step == state.step:  # 16-bit wire: keep what went out
                state.wire_copy = ledger.swap_kept(state.bucket_id, state.step, state.wire_copy)
                state.wire_step = -1
            elif board is None or not self.kept_on_board(job, state, ledger):  # else on the board's other slot, no copy
                # the update pass copies them as it reads them (one worker, or a wire copy not made yet)
                previous = ledger.buffer_to_keep(state.bucket_id, state.step, state.numel, WIRE_DTYPES[job.spec.wire_dtype])
        if board is not None and state.wire_copy is not None:  # 16-bit: cast onto the board from now on, no copy of its own
            state.wire_copy, state.wire_step = None, -1
        assert in_flight.reduction.complete, "only a complete reduction is applied"
        wire = board
        if board is None and job.spec.wire_dtype != "float32":  # the outgoing copy is cast in the same pass
            if state.wire_copy is None:
                state.wire_copy = torch.empty(state.numel, dtype=WIRE_DTYPES[job.spec.wire_dtype])
            wire = state.wire_copy
        segments = job.segments[state.bucket_id]
        absent = in_flight.absent or frozenset()
        # every rank's push was empty (no gradient for any parameter of the bucket, e.g. a frozen layer): no values go back
        unchanged = len(absent) == len(segments) and not in_flight.skip
        hyper = self._overrides.apply(in_flight.hyper)
        if in_flight.skip:
            # GradScaler semantics: no segment is stepped (parameters, moments and AdamW's step counts stay);
            # the protocol step still advances, so the workers get these values as the next step's and go on.
            absent = frozenset(range(len(segments)))
        else:
            self._overrides.applied(job.owned[state.bucket_id].group, hyper)
        if masters_to_board:
            wire_out = None  # the board's slot takes the new masters themselves (param_out)
        elif board is not None or not unchanged or state.wire_step != state.step:
            wire_out = wire
        else:  # nothing changed and the wire copy holds this step's values already
            wire_out = None
        arguments = dict(
            segments=segments,
            absent_everywhere=absent,
            rule=job.spec.rule,
            # with clipping, the sum was divided by world_size for the norm: it is only multiplied
            grad_divisor=job.divisor if in_flight.clip is None else None,
            grad_multiplier=in_flight.clip,
            wire_out=wire_out,
            previous_out=previous,
            compiled=self._update_paths.wants_compiled(state.bucket_id, state.step, state.numel),
            param_out=board if masters_to_board else None,
        )
        pending = PendingUpdate(job, state, in_flight, ledger, hyper, arguments, board, wire, masters_to_board, previous, unchanged)
        pending.bookkeeping_s = time.perf_counter() - started
        return pending

    @staticmethod
    def run(pending: PendingUpdate) -> None:
        """The pass itself: touches the bucket's state and the pass's outputs only, so it may run on a
        thread of its own (:mod:`optimizer_node.update.pass_thread`) while the loop goes on."""
        updating = time.perf_counter()
        pending.applied = update_bucket(pending.state, pending.in_flight.reduction, pending.hyper, **pending.arguments)
        pending.pass_s = time.perf_counter() - updating

    def finish(self, pending: PendingUpdate, error: BaseException | None, deliver: Deliver) -> None:
        """After the pass, on the loop's thread: its timings, the bucket at its next step, the new values
        delivered, the bucket let go. ``error``: what the pass raised, raised here once the bucket is let go."""
        state = pending.state
        if error is not None:
            self._store.release(state, dirty=True)  # the pass may have changed some of it
            raise error
        assert pending.applied is not None, "finish follows the pass"
        started = time.perf_counter()
        timings = self._clock.current
        timings.passes.append(pending.pass_s)
        if pending.applied.changed:
            self._update_paths.record(state.bucket_id, pending.applied.compiled, state.numel, pending.pass_s)
        kept_step = state.step
        if pending.masters_to_board and pending.board is not None:
            state.param, state.param_on_board = pending.board, True
        state.step += 1
        state.wire_step = state.step if pending.wire is not None and pending.board is None else -1
        if pending.board is not None:
            self._replies.board_written(state)
        timings.update_s += pending.bookkeeping_s + pending.pass_s + time.perf_counter() - started
        try:
            deliver(pending.job, state, pending.in_flight, pending.unchanged)
        finally:
            self._store.release(state, dirty=True)
        if pending.previous is not None:
            pending.ledger.keep(state.bucket_id, kept_step, pending.previous)
