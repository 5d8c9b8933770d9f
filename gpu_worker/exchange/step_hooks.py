"""What a full-model worker's hooks do during a step, and whose turn it is with the sockets.

With ``push_during_backward`` a gradient hook on each parameter (:class:`BucketReadiness`) pushes a
bucket as soon as backward has produced all its gradients: at once when the hook runs on the thread
that owns the optimizer, else (autograd's device thread, on a GPU) its copy out of the device is
staged and the :class:`PushCourier` sends it once landed. With ``overlap_forward`` the next forward
waits for each module's new values (:class:`ForwardWaits`). Both are made again when a param group
changes the buckets. The courier uses the sockets only until the owner thread takes them back
(:meth:`StepHooks.take_sockets`: ``step()``, ``synchronize()``, the state dicts).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from gpu_worker.exchange.bucket_readiness import BucketReadiness
from gpu_worker.exchange.forward_waits import ForwardWaits
from gpu_worker.exchange.push_courier import PushCourier
from gpu_worker.layout import GradsOf
from protos.job.hyper import AdamWHyper

if TYPE_CHECKING:
    from gpu_worker.exchange.gradient_pushes import GradientPushes
    from gpu_worker.links.rank_state import RankState


class StepHooks:
    """A full-model worker's gradient hooks and early pushes, its forward waits, and its courier.

    ``courier_send(bucket_id)`` pushes a staged bucket with the step's hyperparameters (the optimizer's
    method, held weakly by the courier so that its thread does not keep the optimizer alive). Nothing
    here holds the optimizer: its gradient hook, given to :meth:`index`, is what the parameters hold.

    Of the session it uses: ``state`` (the buckets and the parameters' names, read at each use),
    ``pushes`` (the step's pushes and staged copies), and the open step's values: ``awaiting()``,
    whether a step awaits them; ``await_upto(bucket_id)``, install them up to a bucket;
    ``complete()``, install the rest and end the step. ``paced``: the pushes wait for room in a push
    window (only the owner thread may then push)."""

    def __init__(
        self,
        state: RankState,
        pushes: GradientPushes,
        *,
        awaiting: Callable[[], bool],
        await_upto: Callable[[int], None],
        complete: Callable[[], None],
        paced: bool,
        owner_thread: int,
        push_early: bool,
        overlap_module: torch.nn.Module | None,
        courier_send: Callable[[int], None],
    ) -> None:
        self._state = state
        self._pushes = pushes
        self._awaiting = awaiting
        self._await_upto = await_upto
        self._complete = complete
        self._owner_thread = owner_thread
        self._push_early = push_early
        self.overlap_module = overlap_module
        """The model whose forward waits for its new values (``overlap_forward``), or ``None``."""
        self.readiness = BucketReadiness()
        self.forward_waits: ForwardWaits | None = None
        self.grads = GradsOf(())
        """The hooks' view of the current gradients, in the layout's order."""
        # Unpaced full-model pushes staged on autograd's device thread leave from a courier thread (a
        # paced push may have to wait for values, which only the owner thread receives).
        self.courier = PushCourier(pushes.sender.wait_staged, courier_send) if push_early and not paced else None

    def index(self, params: Sequence[torch.Tensor], on_grad: Callable[[int, torch.Tensor], None]) -> None:
        """Which parameters each bucket holds and the other way round, and the early-push hooks
        (``on_grad(index, param)``) of the parameters that have none yet (after construction, or
        after a param group was added)."""
        self.grads = GradsOf(params)  # a new view: the optimizer's parameters change with a param group
        self.readiness.index(self._state.buckets, params)
        if self.overlap_module is not None:  # the parameters' buckets changed (a param group was added): hooks anew
            if self.forward_waits is not None:
                self.forward_waits.remove()
            self.forward_waits = ForwardWaits(
                self.overlap_module,
                params,
                self.readiness.param_buckets,
                awaiting=self._awaiting,
                await_upto=self._await_upto,
                complete=self._complete,
                owner_thread=self._owner_thread,
            )
        if self._push_early:
            self.readiness.hook(on_grad)

    def grad_ready(self, index: int, *, sync_enabled: bool, hypers: Callable[[], list[AdamWHyper]]) -> None:
        """Parameter ``index`` has its gradient: push the buckets it made ready (``hypers()``: the
        step's hyperparameters), unless the optimizer is inside ``no_sync`` (``sync_enabled`` false)."""
        # On a GPU autograd runs the hooks on its device thread, which must not block (it launches the
        # rest of backward) nor use the sockets: there the bucket's copy out of the device starts, and
        # the courier thread sends it once landed (or step(), what the courier did not send).
        foreign = threading.get_ident() != self._owner_thread
        if self._awaiting():  # overlap_forward, and a backward whose forward did not end the step
            if foreign:
                raise RuntimeError(
                    "backward began while the last step's values were still awaited (overlap_forward): call the forward of the module "
                    "given as module= (its end completes the step), or optimizer.synchronize() before backward"
                )
            self.synchronize()
        if not sync_enabled:
            return
        for bucket_id in self.readiness.mark(index, self._state.job.params[index].name):
            if bucket_id not in self._pushes.pushed:  # a retried step keeps what the nodes took
                if foreign:
                    staged = self._pushes.stage_bucket(bucket_id, self.grads)
                    if staged and self.courier is not None:
                        self.courier.offer(bucket_id)
                else:
                    self._pushes.push_bucket(bucket_id, self.grads, hypers())

    def synchronize(self) -> None:
        """The body of the optimizer's ``synchronize()``: install the rest of the last step's values,
        if a step awaits them, on the owner thread."""
        if self._awaiting():
            if threading.get_ident() != self._owner_thread:
                raise RuntimeError("synchronize() receives on the connections: call it on the thread that built the optimizer")
            self.take_sockets()
            self._complete()

    def take_sockets(self) -> None:
        """This thread is about to use the connections: the courier sends nothing more of the current
        backward (what it did not send, ``step()`` sends)."""
        if self.courier is not None:
            self.courier.stop()

    def close(self) -> None:
        """End the courier's thread and take every hook off (the optimizer closes)."""
        if self.courier is not None:
            self.courier.close()
        self.readiness.remove_hooks()
        if self.forward_waits is not None:
            self.forward_waits.remove()
