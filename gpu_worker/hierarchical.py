""":class:`HostGroupAdamW`: AdamW on the optimizer nodes for G workers per host that reduce among
themselves first (:mod:`gpu_worker.host_group`), so each host sends one gradient flow to each node and
receives the parameters once.

``H`` hosts x ``G`` workers: every worker builds a :class:`HostGroupAdamW` with its host's group and
``rank``/``world_size`` = its host's index and ``H``. The leader of each group is a rank of an
ordinary netoptim job of ``H`` ranks with ``local_size`` ``G``; the nodes sum the ``H`` host sums in
host order and divide by ``H x G``. With fp32 on the wire the result is bitwise that of torch's AdamW
fed ``(((g00 + g01 + ...) + (g10 + g11 + ...)) + ...) / (H x G)``: each host's gradients summed in
local-rank order, the hosts' sums in host order.

With ``push_during_backward=True`` the exchange follows backward: each member publishes a parameter's
gradient as soon as it is final, the leader adds its followers' gradients of that parameter at once
(the same sums, element by element) and pushes each bucket whose parameters are all summed, so the
host's gradients travel to the nodes while backward computes the rest.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable
from typing import Any

import torch

from gpu_worker.host_group import HostExchange, HostGroup
from gpu_worker.remote_adamw import RemoteAdamW

log = logging.getLogger(__name__)

_HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")


class HostGroupAdamW(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose update runs on the optimizer nodes, for a worker of a host group.

    Args:
        params: the model's parameters or param groups, the same on every worker. Every parameter
            must have a gradient at each step (a host's sum has no "absent" parameters).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``; LR schedulers work on any member (the
            leader's values are the ones the nodes use).
        host_group: this worker's :class:`~gpu_worker.host_group.HostGroup`.
        rank, world_size: this host's index and the number of hosts.
        options: the leader's :class:`~gpu_worker.RemoteAdamW` options (``nodes``, ``wire_dtype``,
            ``timeout_s``, ...); ``timeout_s`` also bounds the waits inside the group.
        push_during_backward: exchange and push each parameter's gradient as backward finishes it
            (one backward per step: accumulate in ``step()``-less passes is refused with an error).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        host_group: HostGroup,
        rank: int,
        world_size: int,
        push_during_backward: bool = False,
        **options: Any,
    ) -> None:
        if options.get("overlap_forward"):
            raise ValueError(
                "overlap_forward is for RemoteAdamW alone: a host group's leader hands the new parameters to the other workers of its host "
                "once the step is over, so no forward could start before them"
            )
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.host_group = host_group
        self._params = [p for group in self.param_groups for p in group["params"]]
        if any(p.dtype != torch.float32 for p in self._params):
            raise TypeError("a host group exchanges fp32 gradients and parameters: keep the parameters fp32")
        numel = sum(p.numel() for p in self._params)
        self._flat = torch.empty(numel, dtype=torch.float32)
        self._offsets = [0]
        for param in self._params[:-1]:
            self._offsets.append(self._offsets[-1] + param.numel())
        self._streaming = push_during_backward
        self._exchange = HostExchange(host_group, numel, float(options.get("timeout_s", 300.0)), pieces=len(self._params) if push_during_backward else 0)
        self._seq = 1  # the initial parameters; each step is the next
        self._remote: RemoteAdamW | None = None
        self._exchanged = [False] * len(self._params)  # this step's gradient of each parameter went through the exchange
        self._owner_thread = threading.get_ident()
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        if push_during_backward:  # before the leader's RemoteAdamW registers its own: a bucket is pushed once summed
            self._hooks = [
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, i)) for i, p in enumerate(self._params) if p.requires_grad
            ]
        try:
            if host_group.leader:
                self._remote = RemoteAdamW(
                    self.param_groups,
                    lr=lr,
                    betas=betas,
                    eps=eps,
                    weight_decay=weight_decay,
                    rank=rank,
                    world_size=world_size,
                    local_size=host_group.local_size,
                    push_during_backward=push_during_backward,
                    **options,
                )
                self._gather(self._params, self._flat)
                self._exchange.publish_parameters(self._flat, self._seq, self._remote.remote_step)
                self._remote_step = self._remote.remote_step
            else:
                self._remote_step = self._exchange.take_parameters(self._flat, self._seq)
                self._scatter(self._flat, self._params)
        except BaseException:
            self._exchange.fail()
            self._exchange.close()
            for hook in self._hooks:
                hook.remove()
            raise

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        """Backward finished ``param``'s gradient: publish it (follower) or add the followers' (leader)."""
        if threading.get_ident() != self._owner_thread:
            return
        if self._exchanged[index]:
            self._exchange.fail()
            raise RuntimeError(
                "a parameter got a second gradient before step(): a host group with push_during_backward=True takes one "
                "backward per step (accumulate with push_during_backward=False)"
            )
        self._exchange_piece(index, param.grad)

    def _exchange_piece(self, index: int, gradient: torch.Tensor) -> None:
        try:
            if self._remote is None:
                self._exchange.publish_piece(index, self._offsets[index], gradient, self._seq + 1)
            else:
                self._exchange.add_piece(index, self._offsets[index], gradient, self._seq + 1)
        except BaseException:
            self._exchange.fail()
            raise
        self._exchanged[index] = True

    @property
    def remote_step(self) -> int:
        """The step the nodes are at: where to resume the data."""
        return self._remote_step

    @staticmethod
    def _gather(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
        offset = 0
        for tensor in tensors:
            flat[offset : offset + tensor.numel()].copy_(tensor.detach().reshape(-1))
            offset += tensor.numel()

    @staticmethod
    def _scatter(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        offset = 0
        with torch.no_grad():
            for tensor in tensors:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Sum the host's gradients (leader), update on the nodes, share the new parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        missing = [i for i, p in enumerate(self._params) if p.grad is None]
        if missing:
            raise ValueError(f"parameters {missing[:5]} have no gradient: in a host group every parameter needs one at each step")
        try:
            if self._streaming:  # the gradients went through the exchange during backward; those whose hook did not fire go now
                for index, param in enumerate(self._params):
                    if not self._exchanged[index]:
                        self._exchange_piece(index, param.grad)
                self._exchanged = [False] * len(self._params)
                self._seq += 1
            else:
                self._seq += 1
                self._gather([p.grad for p in self._params], self._flat)
                if self._remote is None:
                    self._exchange.publish_gradient(self._flat, self._seq)
                else:
                    self._exchange.add_gradients(self._flat, self._seq)
                    self._scatter(self._flat, [p.grad for p in self._params])
            if self._remote is None:
                self._remote_step = self._exchange.take_parameters(self._flat, self._seq)
                self._scatter(self._flat, self._params)
                return loss
            for mine, theirs in zip(self.param_groups, self._remote.param_groups, strict=True):
                theirs.update({key: mine[key] for key in _HYPER_KEYS})  # a scheduler steps this optimizer's groups
            self._remote.step()  # pushes what backward did not (all of it, without push_during_backward)
            self._gather(self._params, self._flat)
            self._remote_step = self._remote.remote_step
            self._exchange.publish_parameters(self._flat, self._seq, self._remote_step)
        except BaseException:
            self._exchange.fail()
            raise
        return loss

    def close(self) -> None:
        """The leader closes its connections to the nodes; the group's shared file goes with it."""
        for hook in self._hooks:
            hook.remove()
        if self._remote is not None:
            self._remote.close()
        self._exchange.close()
