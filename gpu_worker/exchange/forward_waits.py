"""The next forward waits for its own parameters only (``RemoteAdamW(overlap_forward=True)``).

A full-model ``step()`` normally returns once every bucket's new values are installed, so the next
forward starts only after the nodes' last update: the nodes idle through that forward and the start
of the next backward, and the worker idles through their last updates. With ``overlap_forward``,
``step()`` returns once the gradients are out, and each module's forward pre-hook waits for the
values of the buckets up to the last one that holds a parameter of its own. Buckets follow the
parameters' order (``model.parameters()``, the order of a forward in most models) and a node updates
its ready buckets lowest first, so the first layers run while the nodes still update the last ones.

Waiting for every bucket up to the module's last, not just the module's own, keeps a forward correct
that reads an earlier module's parameters directly (an output layer tied to the embedding by
``x @ self.embed.weight.T``). What stays the caller's to keep: no parameter is read outside a
forward, nor a later module's inside one, before :meth:`~gpu_worker.RemoteAdamW.synchronize` (the
optimizer's own methods, ``module.state_dict()`` and the end of the root module's forward call it).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence

import torch
from torch import nn


def check_held(module: nn.Module, params: Sequence[torch.Tensor]) -> None:
    """``ValueError`` unless every one of ``params`` is a parameter of ``module`` (else no forward
    would wait for its new values)."""
    held = {id(p) for p in module.parameters()}
    missing = [i for i, p in enumerate(params) if id(p) not in held]
    if missing:
        raise ValueError(
            f"overlap_forward: {len(missing)} of the optimizer's parameters are not parameters of the module given (the first: "
            f"index {missing[0]}), so no forward would wait for their new values; pass the model that holds every one as module=, "
            "or leave overlap_forward off"
        )


class ForwardWaits:
    """Hooks on ``module`` that wait for the open step's values as its forward goes.

    ``params``: the optimizer's parameters, in its layout's order; ``param_buckets``: each one's
    bucket ids; ``awaiting()``: whether a step's values are still awaited; ``await_upto(b)``: install
    until every bucket up to ``b`` is in; ``complete()``: install the rest and end the step. The hooks
    receive on the sockets, so forward must run on ``owner_thread`` while values are awaited. Every one
    of ``params`` must be a parameter of ``module``: the caller checks it (:func:`check_held`) before
    the nodes hear of them."""

    def __init__(
        self,
        module: nn.Module,
        params: Sequence[torch.Tensor],
        param_buckets: Sequence[Sequence[int]],
        *,
        awaiting: Callable[[], bool],
        await_upto: Callable[[int], None],
        complete: Callable[[], None],
        owner_thread: int,
    ) -> None:
        index = {id(p): i for i, p in enumerate(params)}
        self._awaiting = awaiting
        self._await_upto = await_upto
        self._complete = complete
        self._owner_thread = owner_thread
        self._handles: list = []
        for sub in module.modules():
            buckets = [b for p in sub.parameters(recurse=False) if id(p) in index for b in param_buckets[index[id(p)]]]
            if buckets:
                self._handles.append(sub.register_forward_pre_hook(functools.partial(self._before_forward, max(buckets))))
        self._handles.append(module.register_forward_hook(self._after_forward))
        self._handles.append(module.register_state_dict_pre_hook(self._before_state_dict))

    def _check_thread(self, what: str) -> None:
        if threading.get_ident() != self._owner_thread:
            raise RuntimeError(
                f"{what} ran on another thread while the last step's values were still awaited (overlap_forward): "
                "run forward on the thread that built the optimizer, or call optimizer.synchronize() first"
            )

    def _before_forward(self, upto: int, _module: nn.Module, _args: object) -> None:
        if self._awaiting():
            self._check_thread("a forward")
            self._await_upto(upto)

    def _after_forward(self, _module: nn.Module, _args: object, _output: object) -> None:
        if self._awaiting():  # the rest (buckets after the last module's) before backward or anything else reads them
            self._check_thread("a forward")
            self._complete()

    def _before_state_dict(self, _module: nn.Module, _prefix: str, _keep_vars: bool) -> None:
        if self._awaiting():
            self._check_thread("state_dict()")
            self._complete()

    def remove(self) -> None:
        """Take the hooks off the module."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
