"""``RemoteOptimizer``: what every remote optimizer shares. A ``torch.optim.Optimizer`` whose fp32
master parameters and optimizer state live on optimizer nodes; the subclasses (:class:`~gpu_worker.
RemoteAdamW`, :class:`~gpu_worker.RemoteAdam`, :class:`~gpu_worker.RemoteSGD`,
:class:`~gpu_worker.RemoteLion`) choose the update rule and its hyperparameters."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch

from gpu_worker.buffers import BufferBroadcast
from gpu_worker.discovery import NodeSource, discover_nodes
from gpu_worker.exchange.forward_waits import check_held
from gpu_worker.exchange.step_hooks import StepHooks
from gpu_worker.job_setup import check_options, extend_job, job_from_groups, rank_and_world
from gpu_worker.layerwise.streaming import StreamStats
from gpu_worker.layerwise.units import UnitPlan
from gpu_worker.layout import step_grads
from gpu_worker.links.liveness import WorkerTimeouts
from gpu_worker.optimizer_state import NodeHeldState, entries_to_load, load_state, with_node_state
from gpu_worker.session_start import start_session
from protos.job.hyper import AdamWHyper, validate_for_rule
from transport.host_memory import StepHeap, keep_step_heap


def adam_style_hyper(group: dict[str, Any]) -> AdamWHyper:
    """A param group with ``lr``, ``betas``, ``eps`` and ``weight_decay`` in the wire's five slots."""
    beta1, beta2 = group["betas"]
    return AdamWHyper(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]))


@dataclasses.dataclass(frozen=True)
class RemoteOptions:
    """The options every remote optimizer takes besides its rule's hyperparameters, as its constructor
    was given them (each is documented on :class:`~gpu_worker.RemoteAdamW`). The public constructors
    list them one by one, so that users and type checkers see them; this is what they hand on."""

    nodes: NodeSource = None
    rank: int | None = None
    world_size: int | None = None
    wire_dtype: torch.dtype = torch.float32
    max_grad_norm: float | None = None
    bucket_numel: int | None = None
    bucket_layout: int | None = None
    timeout_s: float = 300.0
    connect_timeout_s: float = 30.0
    heartbeat_s: float = 2.0
    silent_after_s: float = 10.0
    reconnect_s: float = 20.0
    push_during_backward: bool = False
    curve_secret_key: str | None = None
    curve_server_key: str | None = None
    units: UnitPlan | None = None
    push_window_bytes: int = 1 << 30
    pace_window_bytes: int | None = None
    same_host_ipc: bool = True
    connections_per_node: int = 1
    module: torch.nn.Module | None = None
    broadcast_buffers: bool = True
    join_at_step: int | None = None
    local_size: int = 1
    node_bandwidths: Sequence[float] | None = None
    overlap_forward: bool = False
    keep_step_gradients: bool = True
    moments: str = "fp32"
    moment_block: int = 256

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> RemoteOptions:
        """The options among a constructor's arguments (its ``locals()``), picked by name: a constructor
        whose signature lacks one fails here at once (a ``KeyError`` naming it), not with a default."""
        return cls(**{field.name: arguments[field.name] for field in dataclasses.fields(cls)})

    def as_kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments of a remote optimizer's constructor (the values themselves,
        not copies, unlike ``dataclasses.asdict``: ``module`` is the caller's model)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


class RemoteOptimizer(torch.optim.Optimizer):
    """The machinery of a remote optimizer: registration with the nodes, pushes (at ``step()`` or
    during backward), installing the new values, buffers, state dicts, param groups. A subclass
    sets :attr:`rule` and :attr:`torch_group_keys`, maps its param groups in :meth:`_group_hyper`
    when they are not Adam-style, and calls :meth:`_setup` from its ``__init__``. Every option is documented on :class:`~gpu_worker.RemoteAdamW`."""

    rule = "adamw"
    """The update rule the nodes apply (:data:`protos.job.hyper.RULES`)."""
    torch_group_keys: ClassVar[dict[str, Any]] = {}
    """What torch's optimizer of the same rule keeps in each param group besides the hyperparameters."""

    def _setup(self, params: Iterable[Any], defaults: dict[str, Any], options: RemoteOptions) -> None:
        """Register the job with the nodes and start; the options are documented on :class:`~gpu_worker.RemoteAdamW`."""
        nodes = options.nodes
        rank, world_size = options.rank, options.world_size
        wire_dtype, max_grad_norm = options.wire_dtype, options.max_grad_norm
        units, module = options.units, options.module
        overlap_forward, push_during_backward = options.overlap_forward, options.push_during_backward
        curve_secret_key, curve_server_key = options.curve_secret_key, options.curve_server_key
        join_at_step, timeout_s = options.join_at_step, options.timeout_s
        pace_window_bytes, push_window_bytes = options.pace_window_bytes, options.push_window_bytes
        same_host_ipc, connections_per_node = options.same_host_ipc, options.connections_per_node
        keep_step_gradients, broadcast_buffers = options.keep_step_gradients, options.broadcast_buffers
        check_options(
            units=units,
            module=module,
            overlap_forward=overlap_forward,
            curve_secret_key=curve_secret_key,
            curve_server_key=curve_server_key,
            join_at_step=join_at_step,
            push_during_backward=push_during_backward,
            pace_window_bytes=pace_window_bytes,
            push_window_bytes=push_window_bytes,
            max_grad_norm=max_grad_norm,
        )
        nodes = discover_nodes(nodes, timeout_s=timeout_s)  # a list as given; a host file or None: resolved by rank 0, shared
        timeouts = WorkerTimeouts(
            timeout_s=timeout_s,
            connect_timeout_s=options.connect_timeout_s,
            heartbeat_s=options.heartbeat_s,
            silent_after_s=options.silent_after_s,
            reconnect_s=options.reconnect_s,
        )
        torch.optim.Optimizer.__init__(self, params, defaults)
        self.state = NodeHeldState(dict)
        rank, world_size = rank_and_world(rank, world_size)
        job, tensors = job_from_groups(
            self.param_groups,
            units=units,
            num_nodes=len(nodes),
            world_size=world_size,
            bucket_numel=options.bucket_numel,
            bucket_layout=options.bucket_layout,
            wire_dtype=wire_dtype,
            max_grad_norm=max_grad_norm,
            rule=self.rule,
            local_size=options.local_size,
            node_bandwidths=options.node_bandwidths,
            moments=options.moments,
            moment_block=options.moment_block,
        )
        self._params = tensors
        if overlap_forward:
            check_held(module, tensors)  # before the nodes hear of the job
        self._session_owner = id(self)  # see __del__
        self._owner_thread = threading.get_ident()
        self._sync_enabled = True
        self._step_hypers: list[AdamWHyper] | None = None  # read once per step, at the first early push
        self._session, self._streamer = start_session(
            nodes,
            job,
            rank,
            tensors,
            timeouts=timeouts,
            curve_secret_key=curve_secret_key,
            curve_server_key=curve_server_key,
            same_host_ipc=same_host_ipc,
            connections_per_node=connections_per_node,
            keep_step_gradients=keep_step_gradients,
            join_at_step=join_at_step,
            pace_window_bytes=pace_window_bytes,
            units=units,
            push_window_bytes=push_window_bytes,
            hypers=self._hypers_of_step,
            sync_enabled=lambda: self._sync_enabled,
        )
        # A CPU worker's gradients come and go every step: the next step reuses their pages (a
        # layer-wise worker's streamer keeps its own heap).
        host_bytes = sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cpu")
        self._heap: StepHeap | None = keep_step_heap(host_bytes) if self._streamer is None and host_bytes else None
        self._buffers: BufferBroadcast | None = None
        try:
            if module is not None and broadcast_buffers and world_size > 1 and any(True for _ in module.buffers()):
                self._buffers = BufferBroadcast(module, lambda: self._sync_enabled)
            # the gradient hooks' early pushes (and their courier) and overlap_forward's waits
            session = self._session
            self._hooks = StepHooks(
                session.state,
                session.pushes,
                awaiting=lambda: session.awaiting_values,
                await_upto=session.await_values,
                complete=session.complete_step,
                paced=session.pacer is not None,
                owner_thread=self._owner_thread,
                push_early=push_during_backward and units is None,
                overlap_module=module if overlap_forward else None,
                courier_send=self._courier_send,
            )
            self._hooks.index(self._params, self._on_grad_ready)
        except BaseException:
            self._session.close()
            raise

    def _courier_send(self, bucket_id: int) -> None:
        """The courier's push of a staged bucket (its thread holds the sockets meanwhile)."""
        self._session.push_staged(bucket_id, self._hooks.grads, self._hypers_of_step())

    def _on_grad_ready(self, index: int, _param: torch.Tensor) -> None:
        """The gradient hook of ``push_during_backward`` (:meth:`StepHooks.grad_ready`)."""
        self._hooks.grad_ready(index, sync_enabled=self._sync_enabled, hypers=self._hypers_of_step)

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
        self._hooks.take_sockets()
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

    def _group_hyper(self, group: dict[str, Any]) -> AdamWHyper:
        """A param group's current hyperparameters in the wire's five slots (see :mod:`protos.job.hyper`):
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
        each module's new values (:mod:`gpu_worker.exchange.forward_waits`), and a refusal is raised there
        (or by :meth:`synchronize`), the step open as above."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hypers = self._hypers_of_step()
        grads = step_grads(self._params)
        try:
            self._hooks.take_sockets()
            if self._streamer is not None:
                self._streamer.finish_step()
            elif self._hooks.forward_waits is not None:
                self.synchronize()  # a step whose values no forward awaited
                self._session.begin_step(grads, hypers)  # the next forward installs the values (forward_waits)
            else:
                self._session.finish_step(grads, hypers)
            if self._heap is not None:
                self._heap.step_done()
        finally:
            self._step_hypers = None
            self._hooks.readiness.new_step()
        return loss

    def synchronize(self) -> None:
        """Wait until the last step's new values are in every parameter. Only ``overlap_forward``
        leaves a step's values to come after ``step()`` returned; this optimizer's own methods, the
        module's ``state_dict()`` and the end of its forward call it. Call it before reading
        parameters anywhere else (an EMA of the weights, logging their norms). Raises what the step
        would have raised (:class:`~gpu_worker.NonFiniteGradientError` for a refused gradient: the
        step stays open, and ``step()`` again finishes it)."""
        self._hooks.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``. Zeroing in place (``set_to_none=False``) waits for the
        last step first: its gradients are kept until its values are in, to push them again to a node
        that restarts meanwhile."""
        if not set_to_none:
            self.synchronize()
        super().zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The state dict of torch's optimizer of the same rule, gathered from the nodes (AdamW: per
        parameter ``step``, ``exp_avg`` and ``exp_avg_sq``, step 0 and zeros for a parameter never
        stepped, which torch takes as no entry) and the param groups, so the torch optimizer's
        ``load_state_dict`` takes it and continues bit for bit. Under ``"netoptim"``:
        the nodes, their step and the world size. Call it between steps (layer-wise mode waits for the
        last update first). Every rank gets the same dict, its moments on each parameter's device and
        in its dtype, as torch keeps them."""
        self.synchronize()
        self._hooks.take_sockets()
        if self._streamer is not None:
            self._streamer.gather()  # waits until every bucket applied the last step
        session = self._session
        return with_node_state(super().state_dict(), session.state, session.read_state, self._params, self.param_groups, self.torch_group_keys)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of torch's optimizer of the same rule (or from :meth:`state_dict`): the
        param groups here, the moments and step counts onto the nodes, so training continues as torch
        would from it. Moments kept quantized (torchao's ``AdamW8bit``: ``OptimState8bit``) are
        dequantized to fp32 first; the nodes round them to the job's ``moments`` format. Every rank
        calls it with the same dict, between steps, after loading the model's parameters; rank 0
        sends the state, and in full mode the parameters' current values as the nodes' fp32 masters
        (fp32 parameters only: lower-precision ones leave the masters as they are)."""
        state_dict, entries = entries_to_load(state_dict, self.rule, self._params, self.param_groups)  # checked before anything changes
        self.synchronize()
        super().load_state_dict({**state_dict, "state": {}})  # the moments stay off the worker; checks the groups
        self.state = NodeHeldState(dict)
        self._hooks.take_sockets()
        if self._session.rank == 0:
            with_params = self._streamer is None and all(p.dtype == torch.float32 for p in self._params)
            load_state(self._session.state, self._session.load_state, self._params, entries, with_params=with_params)

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
        self.synchronize()
        self._hooks.take_sockets()
        super().add_param_group(param_group)
        self._params = extend_job(session.job, session.extend, self.param_groups, self._params, overlap_module=self._hooks.overlap_module)
        self._hooks.index(self._params, self._on_grad_ready)

    def close(self) -> None:
        """Close the connections to the nodes (also done at garbage collection); with
        ``overlap_forward``, once the last step's values are in."""
        try:
            self.synchronize()
        finally:
            self._close()

    def _close(self) -> None:
        self._hooks.close()
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
            hooks = getattr(self, "_hooks", None)
            if hooks is not None and hooks.courier is not None:
                hooks.courier.close(wait=False)
            session.close()
