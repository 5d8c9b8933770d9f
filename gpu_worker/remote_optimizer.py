"""``RemoteOptimizer``: what every remote optimizer shares. A ``torch.optim.Optimizer`` whose fp32
master parameters and optimizer state live on optimizer nodes; the subclasses (:class:`~gpu_worker.
RemoteAdamW`, :class:`~gpu_worker.RemoteAdam`, :class:`~gpu_worker.RemoteSGD`,
:class:`~gpu_worker.RemoteLion`) choose the update rule and its hyperparameters."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch

from gpu_worker.bucket_readiness import BucketReadiness
from gpu_worker.buffers import BufferBroadcast
from gpu_worker.forward_waits import ForwardWaits, check_held
from gpu_worker.job_setup import job_from_groups, rank_and_world
from gpu_worker.layout import GradsOf, layout_from_groups
from gpu_worker.liveness import WorkerTimeouts
from gpu_worker.optimizer_state import gather_state, load_state, state_entries
from gpu_worker.push_courier import PushCourier
from gpu_worker.push_pacing import PushPacer
from gpu_worker.session import OffloadSession
from gpu_worker.streaming import LayerStreamer, StreamStats
from gpu_worker.units import UnitPlan
from job.discovery import NodeSource, discover_nodes
from job.hyper import AdamWHyper, validate_for_rule
from transport.security import CurveClientConfig
from transport.wire import MsgType

log = logging.getLogger(__name__)


def adam_style_hyper(group: dict[str, Any]) -> AdamWHyper:
    """A param group with ``lr``, ``betas``, ``eps`` and ``weight_decay`` in the wire's five slots."""
    beta1, beta2 = group["betas"]
    return AdamWHyper(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]))


class NodeHeldState(collections.defaultdict):
    """``optimizer.state`` of a remote optimizer: empty on the worker (the state is on the nodes) but
    true, because tools take an empty state for one not made yet and make it by running a step with
    zero gradients and a zero learning rate (``torch.distributed.checkpoint.state_dict``): on the
    nodes that step would count, and decay the moments."""

    def __bool__(self) -> bool:
        return True


class RemoteOptimizer(torch.optim.Optimizer):
    """The machinery of a remote optimizer: registration with the nodes, pushes (at ``step()`` or
    during backward), installing the new values, buffers, state dicts, param groups. A subclass
    sets :attr:`rule` and :attr:`torch_group_keys`, maps its param groups in :meth:`_group_hyper`
    when they are not Adam-style, and calls :meth:`_setup` from its ``__init__``. Every option is documented on :class:`~gpu_worker.RemoteAdamW`."""

    rule = "adamw"
    """The update rule the nodes apply (:data:`job.hyper.RULES`)."""
    torch_group_keys: ClassVar[dict[str, Any]] = {}
    """What torch's optimizer of the same rule keeps in each param group besides the hyperparameters."""

    def _setup(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        nodes: NodeSource = None,
        rank: int | None = None,
        world_size: int | None = None,
        wire_dtype: torch.dtype = torch.float32,
        max_grad_norm: float | None = None,
        bucket_numel: int | None = None,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 30.0,
        heartbeat_s: float = 2.0,
        silent_after_s: float = 10.0,
        reconnect_s: float = 20.0,
        push_during_backward: bool = False,
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
        local_size: int = 1,
        node_bandwidths: Sequence[float] | None = None,
        overlap_forward: bool = False,
        keep_step_gradients: bool = True,
    ) -> None:
        """Register the job with the nodes and start; the optimizer's options are documented on the class."""
        if overlap_forward and (units is not None or module is None):
            raise ValueError(
                "overlap_forward needs module= (the model whose forward waits for its parameters' new values) and full-model mode "
                "(layer-wise mode fetches each unit for its forward already)"
            )
        nodes = discover_nodes(nodes, timeout_s=timeout_s)  # a list as given; a host file or None: resolved by rank 0, shared
        timeouts = WorkerTimeouts(
            timeout_s=timeout_s, connect_timeout_s=connect_timeout_s, heartbeat_s=heartbeat_s, silent_after_s=silent_after_s, reconnect_s=reconnect_s
        )
        torch.optim.Optimizer.__init__(self, params, defaults)
        self.state = NodeHeldState(dict)
        rank, world_size = rank_and_world(rank, world_size)
        job, tensors = job_from_groups(
            self.param_groups,
            units=units,
            num_nodes=len(nodes),
            world_size=world_size,
            bucket_numel=bucket_numel,
            wire_dtype=wire_dtype,
            max_grad_norm=max_grad_norm,
            rule=self.rule,
            local_size=local_size,
            node_bandwidths=node_bandwidths,
        )
        self._params = tensors
        if overlap_forward:
            check_held(module, tensors)  # before the nodes hear of the job
        if bool(curve_secret_key) != bool(curve_server_key):
            raise ValueError("curve_secret_key and curve_server_key go together")
        curve = CurveClientConfig(curve_secret_key, curve_server_key) if curve_secret_key and curve_server_key else None
        self._session_owner = id(self)  # see __del__
        self._session = OffloadSession(
            nodes,
            job,
            rank,
            tensors,
            timeouts=timeouts,
            curve=curve,
            same_host=same_host_ipc,
            connections_per_node=connections_per_node,
            keep_step_gradients=keep_step_gradients,
        )
        self._owner_thread = threading.get_ident()
        self._sync_enabled = True
        self._step_hypers: list[AdamWHyper] | None = None  # read once per step, at the first early push
        self._streamer: LayerStreamer | None = None
        if join_at_step is not None:  # a worker joining a running job: the nodes take it, at the new width, from that step
            if units is not None:
                raise ValueError("a layer-wise job cannot change its width: join_at_step is for full-model jobs")
            self._session.join_at(join_at_step)
        try:
            if pace_window_bytes is not None:  # inside: a refusal closes the connections the session opened
                if units is not None or not push_during_backward:
                    raise ValueError("pace_window_bytes paces the pushes of a full-model worker that pushes during backward (push_during_backward=True)")
                if max_grad_norm is not None:  # no values come back before every gradient is in: a window would wait for ever
                    raise ValueError("pace_window_bytes cannot go with max_grad_norm: clipped values come back only once every gradient is in")
                self._session.pacer, self._session.pacer_ack = PushPacer(pace_window_bytes), MsgType.PARAMS
            if units is None:
                self._session.connect()
            else:
                if push_window_bytes <= 0:
                    raise ValueError(f"push_window_bytes must be positive, got {push_window_bytes}")
                self._session.pacer = PushPacer(push_window_bytes)  # acknowledged by the nodes' CONSUMED
                self._streamer = LayerStreamer(units, self._session, hypers=self._hypers_of_step, sync_enabled=lambda: self._sync_enabled)
                self._streamer.connect()
        except BaseException:
            self._session.close()
            raise
        self._buffers: BufferBroadcast | None = None
        if module is not None and broadcast_buffers and world_size > 1 and any(True for _ in module.buffers()):
            try:
                self._buffers = BufferBroadcast(module, lambda: self._sync_enabled)
            except BaseException:
                self._session.close()
                raise
        self._readiness = BucketReadiness()
        self._overlap_module = module if overlap_forward else None
        self._forward_waits: ForwardWaits | None = None
        self._push_early = push_during_backward and units is None
        # Unpaced full-model pushes staged on autograd's device thread leave from a courier thread (a
        # paced push may have to wait for values, which only the owner thread receives).
        self._courier = PushCourier(self._session.wait_staged, self._courier_send) if self._push_early and self._session.pacer is None else None
        try:
            self._index_buckets(push_during_backward=self._push_early)
        except BaseException:
            self._session.close()
            raise

    def _take_sockets(self) -> None:
        """This thread is about to use the connections: the courier sends nothing more of the current
        backward (what it did not send, ``step()`` sends)."""
        courier = getattr(self, "_courier", None)
        if courier is not None:
            courier.stop()

    def _courier_send(self, bucket_id: int) -> None:
        """The courier's push of a staged bucket (its thread holds the sockets meanwhile)."""
        self._session.push_staged(bucket_id, self._grads, self._hypers_of_step())

    def _index_buckets(self, *, push_during_backward: bool) -> None:
        """Which parameters each bucket holds and the other way round, and the early-push hooks of
        the parameters that have none yet (after construction, or after a param group was added)."""
        self._grads = GradsOf(self._params)  # the hooks' view of the current gradients (self._params changes with a param group)
        self._readiness.index(self._session.buckets, self._params)
        if self._overlap_module is not None:  # the parameters' buckets changed (a param group was added): hooks anew
            if self._forward_waits is not None:
                self._forward_waits.remove()
            session = self._session
            self._forward_waits = ForwardWaits(
                self._overlap_module,
                self._params,
                self._readiness.param_buckets,
                awaiting=lambda: session.awaiting_values,
                await_upto=session.await_values,
                complete=session.complete_step,
                owner_thread=self._owner_thread,
            )
        if push_during_backward:
            self._readiness.hook(self._on_grad_ready)

    @property
    def remote_step(self) -> int:
        """The number of updates the nodes have applied: where to resume the data."""
        self.synchronize()
        return self._session.step

    @property
    def rank(self) -> int:
        """This worker's rank in the job (it changes when the job morphs)."""
        return self._session.rank

    @property
    def world_size(self) -> int:
        """The job's data-parallel width (it changes when the job morphs)."""
        return self._session.job.world_size

    @property
    def leave_requested(self) -> str | None:
        """Why an operator asked this worker to leave the job (``netoptim admin morph --leave``), or ``None``;
        :meth:`gpu_worker.elastic.ElasticGroup.follow` acts on it."""
        return self._session.news.leave_requested

    def morph(self, rank: int, world_size: int, at_step: int) -> None:
        """Go on as ``rank`` of ``world_size`` workers from step ``at_step``, the step the job's workers
        agreed to change its width at (:class:`gpu_worker.elastic.ElasticGroup` agrees on it and calls
        this). Between steps only (after ``step()``, before the next step's gradients are pushed); the
        nodes keep the parameters and moments and average the following steps over the new width."""
        if self._buffers is not None:
            raise RuntimeError("this optimizer broadcasts buffers over a torch.distributed group of a fixed size: pass broadcast_buffers=False to morph")
        self.synchronize()
        self._take_sockets()
        self._session.morph(rank, world_size, at_step)

    @property
    def shared_memory_bytes(self) -> dict[str, int]:
        """Payload bytes (``sent``, ``received``) that went through shared memory with nodes on this
        host rather than through a socket (the rest did; see docs/transports.md); ``sent_in_place``:
        the gradients among them gathered straight into the node's window (no copy at send)."""
        return self._session.shared_memory_bytes

    @property
    def device_copy_bytes(self) -> dict[str, int]:
        """On a GPU: parameter bytes copied up to the device, ``direct`` from same-host nodes'
        page-locked windows and boards, ``staged`` through pinned buffers (a CPU copy first); zeros on CPU."""
        return self._session.device_copy_bytes if self._streamer is None else self._streamer.device_copy_bytes

    @property
    def stream_stats(self) -> StreamStats | None:
        """Layer-wise mode: fetch waits, transfer times and the peak parameter bytes this worker held."""
        return None if self._streamer is None else self._streamer.stats

    def gather_parameters(self) -> dict[str, torch.Tensor]:
        """Layer-wise mode: every parameter's current value from the nodes (waits for the last
        update), copied to the CPU one unit at a time. Full mode: copies of the local parameters."""
        if self._streamer is not None:
            return self._streamer.gather()
        self.synchronize()
        return {spec.name: p.detach().to("cpu", copy=True) for spec, p in zip(self._session.job.params, self._params, strict=True)}

    def _hypers_of_step(self) -> list[AdamWHyper]:
        if self._step_hypers is None:
            self._step_hypers = self._group_hypers()
        return self._step_hypers

    @property
    def max_grad_norm(self) -> float | None:
        """The global norm the nodes clip the averaged gradient to (``max_grad_norm=``), or ``None``."""
        return self._session.job.max_grad_norm

    @property
    def last_grad_norm(self) -> float | None:
        """With ``max_grad_norm``: the global norm of the last averaged gradient, before clipping."""
        self.synchronize()
        return self._session.news.last_grad_norm

    @property
    def last_step_skipped(self) -> bool:
        """Whether the nodes skipped the last step (``netoptim node --non-finite skip``: a gradient held
        NaN/inf, so nothing changed, as with GradScaler). Layer-wise mode: known once the next forward began."""
        self.synchronize()
        skipped = self._session.news.last_skipped_step
        return skipped is not None and skipped == self._session.step - 1

    @property
    def skipped_steps(self) -> int:
        """Steps the nodes skipped for a non-finite gradient since this optimizer was made."""
        self.synchronize()
        return self._session.news.skipped_steps

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without pushing them (as DDP's
        ``no_sync``); the next backward outside pushes the accumulated gradients."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _on_grad_ready(self, index: int, _param: torch.Tensor) -> None:
        # On a GPU autograd runs the hooks on its device thread, which must not block (it launches the
        # rest of backward) nor use the sockets: there the bucket's copy out of the device starts, and
        # the courier thread sends it once landed (or step(), what the courier did not send).
        foreign = threading.get_ident() != self._owner_thread
        if self._session.awaiting_values:  # overlap_forward, and a backward whose forward did not end the step
            if foreign:
                raise RuntimeError(
                    "backward began while the last step's values were still awaited (overlap_forward): call the forward of the module "
                    "given as module= (its end completes the step), or optimizer.synchronize() before backward"
                )
            self.synchronize()
        if not self._sync_enabled:
            return
        for bucket_id in self._readiness.mark(index, self._session.job.params[index].name):
            if not self._session.has_pushed(bucket_id):  # a retried step keeps what the nodes took
                if foreign:
                    staged = self._session.stage_bucket(bucket_id, self._grads)
                    if staged and self._courier is not None:
                        self._courier.offer(bucket_id)
                else:
                    self._session.push_bucket(bucket_id, self._grads, self._hypers_of_step())

    def _group_hyper(self, group: dict[str, Any]) -> AdamWHyper:
        """A param group's current hyperparameters in the wire's five slots (see :mod:`job.hyper`):
        ``lr``, ``betas``, ``eps`` and ``weight_decay`` as AdamW and Adam keep them; rules whose groups
        hold other keys (SGD, Lion) map theirs."""
        return adam_style_hyper(group)

    def _group_hypers(self) -> list[AdamWHyper]:
        hypers = []
        for group in self.param_groups:
            hyper = self._group_hyper(group)
            validate_for_rule(self.rule, hyper)
            hypers.append(hyper)
        return hypers

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Send the gradients, wait for the nodes' update and install the new parameters.

        Raises :class:`~gpu_worker.NonFiniteGradientError` when the nodes refuse a gradient of this
        rank that holds NaN or inf (their default, ``--non-finite refuse``): nothing was applied to
        those buckets and the step is still open; calling ``step()`` again with finite gradients
        finishes it (the other ranks wait meanwhile).

        With ``overlap_forward`` it returns once the gradients are out; the next forward waits for
        each module's new values (:mod:`gpu_worker.forward_waits`), and a refusal is raised there
        (or by :meth:`synchronize`), the step open as above."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hypers = self._hypers_of_step()
        grads = [p.grad for p in self._params]
        for param, grad in zip(self._params, grads, strict=True):
            if grad is not None and grad.is_sparse:
                raise TypeError("RemoteAdamW does not support sparse gradients")
            if grad is not None and not math.prod(grad.shape) == param.numel():
                raise ValueError("a gradient's shape differs from its parameter's")
        try:
            self._take_sockets()
            if self._streamer is not None:
                self._streamer.finish_step()
            elif self._forward_waits is not None:
                self.synchronize()  # a step whose values no forward awaited
                self._session.begin_step(grads, hypers)  # the next forward installs the values (forward_waits)
            else:
                self._session.finish_step(grads, hypers)
        finally:
            self._step_hypers = None
            self._readiness.new_step()
        return loss

    def synchronize(self) -> None:
        """Wait until the last step's new values are in every parameter. Only ``overlap_forward``
        leaves a step's values to come after ``step()`` returned; this optimizer's own methods, the
        module's ``state_dict()`` and the end of its forward call it. Call it before reading
        parameters anywhere else (an EMA of the weights, logging their norms). Raises what the step
        would have raised (:class:`~gpu_worker.NonFiniteGradientError` for a refused gradient: the
        step stays open, and ``step()`` again finishes it)."""
        session = self._session
        if session.awaiting_values:
            if threading.get_ident() != self._owner_thread:
                raise RuntimeError("synchronize() receives on the connections: call it on the thread that built the optimizer")
            self._take_sockets()
            session.complete_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``. Zeroing in place (``set_to_none=False``) waits for the
        last step first: its gradients are kept until its values are in, to push them again to a node
        that restarts meanwhile."""
        if not set_to_none:
            self.synchronize()
        super().zero_grad(set_to_none)

    def _torch_indices(self) -> dict[int, int]:
        """Each parameter's index in torch's state dict: its place over the param groups, in order."""
        return {id(p): i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}

    def state_dict(self) -> dict[str, Any]:
        """The state dict of torch's optimizer of the same rule, gathered from the nodes (AdamW: per
        parameter ``step``, ``exp_avg`` and ``exp_avg_sq``, step 0 and zeros for a parameter never
        stepped, which torch takes as no entry) and the param groups, so the torch optimizer's
        ``load_state_dict`` takes it and continues bit for bit. Under ``"netoptim"``:
        the nodes, their step and the world size. Call it between steps (layer-wise mode waits for the
        last update first). Every rank gets the same dict, its moments on each parameter's device and
        in its dtype, as torch keeps them."""
        self.synchronize()
        self._take_sockets()
        if self._streamer is not None:
            self._streamer.gather()  # waits until every bucket applied the last step
        state = super().state_dict()
        for group in state["param_groups"]:  # torch AdamW's own keys; the nodes run its fused kernel, so a torch run resumed from here uses it too
            for key, value in self.torch_group_keys.items():
                group.setdefault(key, value)
        state["state"] = gather_state(self._session, self._params, self._torch_indices())
        state["netoptim"] = {
            "state_location": "optimizer_nodes",
            "nodes": list(self._session.nodes),
            "step": self.remote_step,
            "world_size": self._session.job.world_size,
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of torch's optimizer of the same rule (or from :meth:`state_dict`): the
        param groups here, the moments and step counts onto the nodes, so training continues as torch
        would from it. Every rank calls it with the same dict, between steps, after loading the model's
        parameters; rank 0 sends the state, and in full mode the parameters' current values as the
        nodes' fp32 masters (fp32 parameters only: lower-precision ones leave the masters as they are)."""
        state_dict = dict(state_dict)
        state_dict.pop("netoptim", None)
        for group in state_dict.get("param_groups", []):
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("the state dict's param groups use amsgrad or maximize, which RemoteAdamW does not support")
        moments = state_dict.get("state", {})
        # The state's keys, as torch reads them: the saved groups' "params" (indices, or parameter
        # names from torch.distributed.checkpoint), in the order of this optimizer's groups.
        saved_groups = state_dict.get("param_groups", [])
        key_of = {
            id(p): key for saved, group in zip(saved_groups, self.param_groups, strict=False) for key, p in zip(saved["params"], group["params"], strict=False)
        }
        entries = state_entries(self.rule, self._params, key_of, moments)  # checked before anything changes
        self.synchronize()
        super().load_state_dict({**state_dict, "state": {}})  # the moments stay off the worker; checks the groups
        self.state = NodeHeldState(dict)
        self._take_sockets()
        if self._session.rank == 0:
            with_params = self._streamer is None and all(p.dtype == torch.float32 for p in self._params)
            load_state(self._session, self._params, entries, with_params=with_params)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, as ``torch.optim.Optimizer.add_param_group`` (progressive unfreezing).

        After construction every rank calls it at the same point between steps, with parameters
        equal on every rank; the nodes take them in new buckets after the existing ones, with zero
        moments and step counts, as torch starts their state. Full mode only (layer-wise mode
        streams a fixed set of units: give every parameter at construction, with
        ``requires_grad=False`` for those to train later)."""
        session = getattr(self, "_session", None)
        if session is None:  # while the optimizer is built
            super().add_param_group(param_group)
            return
        if self._streamer is not None:
            raise ValueError(
                "layer-wise mode cannot add a param group after the optimizer is made: give every parameter at construction, the ones to train later "
                "with requires_grad=False, and unfreeze them with requires_grad_(True) when their time comes"
            )
        known = {id(p) for p in self._params}
        self.synchronize()
        self._take_sockets()
        super().add_param_group(param_group)
        specs, tensors = layout_from_groups(self.param_groups)
        try:
            if any(id(p) in known for p in tensors[len(self._params) :]) or [id(p) for p in tensors[: len(self._params)]] != [id(p) for p in self._params]:
                raise ValueError("the added param group must hold only parameters new to this optimizer")
            if self._overlap_module is not None:
                check_held(self._overlap_module, tensors)
            session.extend(dataclasses.replace(session.job, params=tuple(specs)), tensors)
        except BaseException:
            self.param_groups.pop()
            raise
        self._params = tensors
        self._index_buckets(push_during_backward=self._push_early)

    def close(self) -> None:
        """Close the connections to the nodes (also done at garbage collection); with
        ``overlap_forward``, once the last step's values are in."""
        try:
            self.synchronize()
        finally:
            self._close()

    def _close(self) -> None:
        if getattr(self, "_courier", None) is not None:
            self._courier.close()
        self._readiness.remove_hooks()
        if self._forward_waits is not None:
            self._forward_waits.remove()
        if self._streamer is not None:
            self._streamer.remove_hooks()
        if self._buffers is not None:
            self._buffers.remove()
        self._session.close()

    def __del__(self) -> None:
        # Only the optimizer that opened the session closes it when collected: a wrapper made from a
        # copy of its __dict__ (Lightning's LightningOptimizer subclasses the optimizer's class) shares
        # the session and may be collected while the optimizer trains on.
        session = getattr(self, "_session", None)
        if session is not None and getattr(self, "_session_owner", id(self)) == id(self):
            courier = getattr(self, "_courier", None)
            if courier is not None:
                courier.close(wait=False)
            session.close()
