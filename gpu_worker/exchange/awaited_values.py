"""The new values a full-model worker waits for, and their install.

A full-model worker pulls every bucket's values when it connects (and the added buckets after a param
group was added: :meth:`AwaitedValues.pull`), and after each step's pushes it waits for every bucket's
new values (:meth:`AwaitedValues.begin`, :meth:`AwaitedValues.await_upto`,
:meth:`AwaitedValues.complete`). Each value is checked against what is awaited (its node, its size,
its step) before it goes into the parameters. When the nodes refuse this rank's gradient of a bucket
(NaN/inf, ``--non-finite refuse``), the step collects the refusals and raises once everything else is
back or blocked; it then stays open, and the next step pushes the refused buckets again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from gpu_worker.links.connections import NonFiniteGradientError
from gpu_worker.links.step_timings import elapsed
from protos.job.hyper import AdamWHyper
from transport.interface import Message

if TYPE_CHECKING:
    from gpu_worker.exchange.gradient_pushes import GradientPushes
    from gpu_worker.exchange.push_pacing import PushPacer
    from gpu_worker.exchange.value_installer import ValueInstaller
    from gpu_worker.links.messages import ParamsRoute
    from gpu_worker.links.rank_state import RankState
    from gpu_worker.links.refusals import RefusedGradients

log = logging.getLogger(__name__)

TAKE_WAITING_ROUNDS = 16
"""A forward's wait for values (``overlap_forward``) also takes up to this many more messages per node
that are already here, without waiting."""

StepGradients = tuple[Sequence[torch.Tensor | None], Sequence[AdamWHyper]]
"""The gradients of a step (``grads[i]`` belongs to ``params[i]``) and each param group's hyperparameters."""


class AwaitedValues:
    """A full-model worker's open step, from its last pushes to every bucket's new values installed.

    ``waiting``: the buckets whose new values the open step waits for; ``first_awaited``: no bucket
    below it is awaited (:meth:`await_upto` moves it up, a reconnect down); ``grads``: the open
    step's gradients, kept so that a node that restarts mid-step gets them again (with
    ``keep_gradients`` off, only while the step's pushes go out); ``awaiting``: between
    :meth:`begin` and the end of :meth:`complete`.

    What it uses of the rest of the session: ``state``, read at each bucket (each may change between
    steps); ``route``, where it points the nodes' PARAMS while it awaits values; ``pacer``, the push
    window, if any; ``request(bucket_id, at_step)``, a PULL; ``receive_until(done, missing)``, the
    wait for the nodes' messages; ``has_reconnected(node_index)``, whether values may come twice."""

    def __init__(
        self,
        state: RankState,
        pushes: GradientPushes,
        refusals: RefusedGradients,
        installer: ValueInstaller,
        *,
        route: ParamsRoute,
        pacer: PushPacer | None,
        request: Callable[[int, int], None],
        receive_until: Callable[[Callable[[], bool], Callable[[], str]], None],
        has_reconnected: Callable[[int], bool],
        keep_gradients: bool = True,
    ) -> None:
        self.keep_gradients = keep_gradients
        self._state = state
        self._route = route
        self._pacer = pacer
        self._request = request
        self._receive_until = receive_until
        self._has_reconnected = has_reconnected
        self._pushes = pushes
        self._refusals = refusals
        self._installer = installer
        self.waiting: set[int] = set()
        self.first_awaited = 0
        self.grads: StepGradients | None = None
        self.awaiting = False

    def pull(self, bucket_ids: Iterable[int], at_step: int, which: str) -> None:
        """Ask for the values of ``bucket_ids`` at ``at_step`` and install them as they come (``which``
        says what they are in the timeout's message)."""
        waiting = set(bucket_ids)
        for bucket_id in sorted(waiting):
            self._request(bucket_id, at_step)
        self._route.handler = lambda index, message: self.install(index, message, waiting, expect_next_step=False)
        try:
            self._receive_until(lambda: not waiting, lambda: f"no values for {len(waiting)} bucket(s){which}")
        finally:
            self._route.handler = None
        self._installer.settle()

    def begin(self, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> None:
        """Push every bucket not pushed yet; the new values are then awaited (:attr:`awaiting`) until
        :meth:`complete`, in part by :meth:`await_upto`."""
        state, refusals = self._state, self._refusals
        if refusals.step_open:  # a retry: the refused buckets go again
            refusals.retry(state.rank)
        else:
            self.waiting = set(range(len(state.buckets)))
            refusals.new_step()
        self.first_awaited = 0
        self.grads = (grads, hypers)  # a node that restarts mid-step gets them again
        self._pushes.push_remaining(grads, hypers)
        if not self.keep_gradients:  # RemoteAdamW(keep_step_gradients=False): their memory goes with the caller's zero_grad()
            self.grads = None
        for bucket_id in sorted(self._pushes.skipped):  # their new values went to the process this one replaces
            self._request(bucket_id, state.bucket_steps[bucket_id] + 1)
        self._pushes.skipped.clear()
        waiting = self.waiting

        def handler(index: int, message: Message) -> None:
            self.install(index, message, waiting, expect_next_step=True)

        self._route.handler = handler
        refusals.collecting = True
        self.awaiting = True
        try:
            if self._pacer is not None:
                self._pacer.replay(handler)
        except BaseException:
            self.end()
            raise

    @contextlib.contextmanager
    def held(self, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper]) -> Iterator[None]:
        """While a full-model push waits for room in the push window (during backward, before the step
        holds its gradients): ``grads`` held for a node that restarts meanwhile."""
        if self.grads is not None or self._state.job.mode == "layerwise":
            yield
            return
        self.grads = (grads, hypers)
        try:
            yield
        finally:
            self.grads = None

    def await_upto(self, upto: int, take_waiting: Callable[[int], None]) -> None:
        """Install values as they come until every bucket up to ``upto`` is in, then take what else is
        here already (``take_waiting``, the receive loop's). A refusal of this rank's gradient ends the
        step as :meth:`complete` does; so does any error."""
        waiting = self.waiting
        if self.first_awaited > upto and not self._refusals.refused:  # what this forward needs is in already
            return

        def done() -> bool:
            first = self.first_awaited  # buckets come back lowest first: a pointer, not a scan
            while first <= upto and first not in waiting:
                first += 1
            self.first_awaited = first
            return first > upto or bool(self._refusals.refused)

        try:
            self._receive_until(done, lambda: f"no parameters for bucket(s) {sorted(b for b in waiting if b <= upto)[:8]} (of {len(waiting)} missing)")
            # And what else is here already: installed early (their copies start sooner), and values
            # from a remote node do not pile up in the socket's queue while the forward computes.
            take_waiting(TAKE_WAITING_ROUNDS)
        except BaseException:
            self.end()
            raise
        if self._refusals.refused:
            self.complete()  # raises once the rest is back or blocked

    def complete(self) -> None:
        """Install every remaining value of the open step and end it; :class:`NonFiniteGradientError`
        when the nodes refused this rank's gradient of some buckets (the step stays open)."""
        state, waiting = self._state, self.waiting
        try:
            # Done when every bucket is back, or, after a refusal of this rank's gradient, when each one
            # still missing waits for a refused gradient (this rank's, or another's it was told about).
            self._receive_until(
                lambda: not waiting or self._refusals.only_blocked_left(waiting, state.bucket_steps),
                lambda: f"no parameters for {len(waiting)} bucket(s)",
            )
            if waiting:
                self._refusals.step_open = True
                raise NonFiniteGradientError(state.rank, self._refusals.in_order(), state.describe_bucket)
        finally:
            self.end()

    def end(self) -> None:
        """The open step's wait is over: the staged copies and, unless a refusal keeps the step open,
        what the step pushed and awaited are dropped."""
        refusals = self._refusals
        self.awaiting = False
        self._route.handler = None
        refusals.collecting = False
        self._installer.settle()
        self._pushes.sender.drop_staged()  # what was staged and not sent (a retried step stages again)
        if not refusals.step_open:
            if self._pacer is not None:
                self._pacer.clear()
            self._pushes.pushed.clear()
            self.grads = None
            self.waiting = set()
            refusals.clear()

    def await_again(self, bucket_id: int, step: int) -> None:
        """A node that restarted lost the update of ``bucket_id`` past ``step``: its values of the next
        step are awaited again."""
        self._state.bucket_steps[bucket_id] = step
        self.waiting.add(bucket_id)
        self.first_awaited = min(self.first_awaited, bucket_id)

    def collect_refusal(self, error: NonFiniteGradientError) -> bool:
        """finish_step: note that a node refused this rank's gradient of a bucket it waits for (the
        step raises once the rest is in); False where it must raise now (layer-wise, another rank's)."""
        state = self._state
        node, bucket_id, step, _values = error.refusals[0]
        if not self._refusals.collecting or error.rank != state.rank or bucket_id not in self.waiting or step != state.bucket_steps[bucket_id]:
            return False
        self._refusals.record(bucket_id, error.refusals[0], state.rank)
        self._pushes.pushed.pop(bucket_id, None)  # the node does not hold it: the retry pushes it again
        log.warning("rank %d: node %s refused this rank's gradient of bucket %d at step %d (NaN/inf)", state.rank, node, bucket_id, step)
        return True

    def install(self, node_index: int, message: Message, waiting: set[int], expect_next_step: bool) -> None:
        """One bucket's values from node ``node_index``, checked against what is awaited (``waiting``; the
        bucket's next step or, ``expect_next_step`` False, the step it is at) and installed."""
        state = self._state
        header = message.header
        bucket_id = header.bucket_id
        if (
            self._has_reconnected(node_index)
            and 0 <= bucket_id < len(state.buckets)
            and header.step == state.bucket_steps[bucket_id]
            and (expect_next_step or bucket_id not in waiting)
        ):
            return  # after a reconnect, values already installed can come twice (asked for again and broadcast)
        if bucket_id not in waiting or state.buckets[bucket_id].node != node_index:
            raise RuntimeError(f"node {state.nodes[node_index]} sent bucket {bucket_id}, which this worker did not ask it for")
        bucket = state.buckets[bucket_id]
        unchanged = header.meta.get("unchanged") is True and header.numel == 0  # no rank had a gradient for it: the values stay
        if not unchanged and (header.numel != bucket.numel or header.dtype != state.job.wire_dtype):
            raise RuntimeError(
                f"node {state.nodes[node_index]} sent bucket {bucket_id} as {header.numel} x {header.dtype}, expected {bucket.numel} x {state.job.wire_dtype}"
            )
        expected = state.bucket_steps[bucket_id] + (1 if expect_next_step else 0)
        if header.step != expected:
            raise RuntimeError(f"node {state.nodes[node_index]} sent bucket {bucket_id} of step {header.step}, expected step {expected}")
        if not unchanged:
            started = time.perf_counter()
            self._installer.install(bucket, message, state.params, node=state.nodes[node_index])
            state.timings.install_s += elapsed(started)
            state.timings.installs += 1
        state.bucket_steps[bucket_id] = header.step
        waiting.discard(bucket_id)
