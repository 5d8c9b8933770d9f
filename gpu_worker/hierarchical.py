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
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from gpu_worker.discovery import NodeSource
from gpu_worker.host_group import HostExchange, HostGroup
from gpu_worker.layerwise.units import UnitPlan
from gpu_worker.remote_adamw import RemoteAdamW
from gpu_worker.remote_optimizer import RemoteOptions

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
        push_during_backward: exchange and push each parameter's gradient as backward finishes it
            (one backward per step: accumulate in ``step()``-less passes is refused with an error).
        overlap_forward: refused (``True`` raises): the new parameters reach the group once the step is over.
        nodes: where the optimizer nodes are: addresses, a host file's path, or ``None`` (the environment).
        wire_dtype: dtype of gradients and parameters on the wire (float32, bfloat16 or float16).
        max_grad_norm: clip the averaged gradient to this global L2 norm (``None``: no clipping).
        bucket_numel: elements per transfer/update unit (``None``: chosen for the model and node count).
        bucket_layout: 1 fills each bucket, 2 never splits a parameter that fits one (``None``: the mode's).
        timeout_s: how long a wait for the nodes, or inside the group, may go without progress before a ``TimeoutError``.
        connect_timeout_s: how long a node may take to answer the first HELLO.
        heartbeat_s, silent_after_s, reconnect_s: ping a node silent this long; take one silent this long
            for gone; reconnect to it for up to this long.
        curve_secret_key, curve_server_key: this worker's secret key file and the node's public key file (CURVE).
        units: layer-wise mode's plan (:func:`gpu_worker.offload` sets it).
        push_window_bytes: layer-wise mode: gradient bytes pushed and not yet consumed by the nodes.
        pace_window_bytes: full-model mode with ``push_during_backward``: gradient bytes pushed whose
            values have not come back (``None``: no window).
        same_host_ipc: move to a same-host node's Unix socket.
        connections_per_node: TCP connections to each node.
        module: the model the parameters belong to, for its buffers and ``overlap_forward``.
        broadcast_buffers: with ``module``: rank 0's buffers reach every rank at each training forward.
        join_at_step: a worker joining a running job at this step (:mod:`gpu_worker.elastic`).
        node_bandwidths: each node's link bandwidth: buckets are shared out in proportion.
        keep_step_gradients: hold each step's gradients until its values are in (a node may restart mid-step).
        moments, moment_block: how the nodes store the moments (``"fp32"``, ``"bf16"``, ``"8bit"``), as :class:`~gpu_worker.RemoteAdamW`.

    The options from ``nodes`` on are the leader's :class:`~gpu_worker.RemoteAdamW` options, with its
    defaults; its docstring describes each in full. ``local_size`` is the group's.
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
        nodes: NodeSource = None,
        wire_dtype: torch.dtype = torch.float32,
        max_grad_norm: float | None = None,
        bucket_numel: int | None = None,
        bucket_layout: int | None = None,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 30.0,
        heartbeat_s: float = 2.0,
        silent_after_s: float = 10.0,
        reconnect_s: float = 20.0,
        curve_secret_key: str | None = None,
        curve_server_key: str | None = None,
        units: UnitPlan | None = None,
        push_window_bytes: int = 1 << 30,
        pace_window_bytes: int | None = None,
        same_host_ipc: bool = True,
        connections_per_node: int = 1,
        module: torch.nn.Module | None = None,
        broadcast_buffers: bool = True,
        join_at_step: int | None = None,
        node_bandwidths: Sequence[float] | None = None,
        overlap_forward: bool = False,
        keep_step_gradients: bool = True,
        moments: str = "fp32",
        moment_block: int = 256,
    ) -> None:
        if overlap_forward:
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
        self._exchange = HostExchange(host_group, numel, float(timeout_s), pieces=len(self._params) if push_during_backward else 0)
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
                    **RemoteOptions.from_arguments({**locals(), "local_size": host_group.local_size}).as_kwargs(),
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
