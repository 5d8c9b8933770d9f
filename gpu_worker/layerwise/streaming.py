"""Layer-wise mode at run time: which units a worker holds, fetched just in time and freed after use.

Life of a step (``k`` is the step the worker is at):

- forward: the root unit and the first ``prefetch`` units are requested when the model's forward
  begins; before unit ``u`` runs it must have arrived (the worker waits only if it has not), and units
  ``u+1 .. u+prefetch`` are requested; after it ran its parameters are freed (the last ``prefetch + 1``
  units stay: backward needs them first, and they are no more than the window forward held; and
  more of the last ones, as many as ``keep_for_backward`` bytes hold).
- backward: when the gradient of a unit's output is ready (a hook on the output tensor), the unit is
  fetched again and ``u-1 .. u-prefetch`` are requested. When every parameter of a unit has its
  gradient, the unit's buckets are pushed, its gradients and parameters freed.
- ``step()``: whatever was not pushed (parameters that got no gradient count as zeros, as in DDP) is
  pushed, and the worker moves to step ``k+1`` without waiting: the next forward asks for each unit
  at ``k+1``, and each node answers as soon as that bucket's update is applied, lowest bucket first.

Freed means the parameter's storage is resized to zero bytes; the tensor object, and autograd's
references to it, stay. Values are written through ``.data``, which does not bump the version
counter autograd checks, so the tensors saved for backward are valid again once refetched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_flatten

from gpu_worker.layerwise.board_aliases import BoardAliases
from gpu_worker.layerwise.device_copy import HostToDevice, wait_on_host
from gpu_worker.layerwise.landed_pushes import LandedPushes
from gpu_worker.layerwise.units import UnitPlan, initialize, kept_for_backward
from gpu_worker.layout import GradsOf, finish_board_read
from protos.job.hyper import AdamWHyper
from transport.host_memory import keep_step_heap, trim_host_heap
from transport.interface import Message
from transport.wire import WIRE_DTYPES

if TYPE_CHECKING:
    from gpu_worker.links.messages import ParamsRoute
    from gpu_worker.links.rank_state import RankState

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Unit:
    index: int
    name: str
    params: list[int]  # layout indices
    buckets: list[int]
    step: int = -1  # step of the values held or on their way
    pending: set[int] = field(default_factory=set)  # buckets requested, not arrived
    resident: bool = False  # storage allocated (values held, or arriving)
    requested_at: float = 0.0
    ready_event: object = None  # CUDA event after the host-to-device copies of the values
    grads_ready: set[int] = field(default_factory=set)
    waits_for: int | None = None  # this step: gradients backward must produce before the unit is pushed (-1: step() pushes it)
    pushed: bool = False


@dataclass
class StreamStats:
    """What the worker measured of its own streaming (seconds and bytes, cumulative)."""

    fetch_wait_s: float = 0.0  # time the worker was blocked waiting for parameters
    fetch_transfer_s: float = 0.0  # summed request-to-arrival time of every unit fetch
    fetches: int = 0
    fetched_bytes: int = 0
    peak_param_bytes: int = 0  # the most parameter bytes ever held at once (measured at every hook)

    @property
    def hidden_fraction(self) -> float:
        """Share of the fetch time that overlapped compute instead of blocking the worker."""
        return 1.0 - self.fetch_wait_s / self.fetch_transfer_s if self.fetch_transfer_s > 0 else 1.0


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass(frozen=True, slots=True)
class StreamLinks:
    """What the streamer uses of the worker's links to its nodes (the session composes it).

    ``state``: this rank's place in the job (parameters, buckets, nodes, the step to resume at);
    ``route``: where the nodes' PARAMS go (the streamer sets its handler); ``hello()``: register, and
    the buckets the nodes still need initial values of; ``send_initial(bucket, values)``;
    ``request(bucket, step)``: PULL; ``receive_until(done, missing)``: receive until ``done()``;
    ``has_reconnected(node)``: whether a node's connection was reopened this step;
    ``stage``/``push``/``landed``: a bucket's gradients staged, pushed, and whether its staged copy
    landed; ``advance(buckets)``: the step's end for them; ``release_send_buffers()``."""

    state: RankState
    route: ParamsRoute
    hello: Callable[[], Iterable[int]]
    send_initial: Callable[[int, torch.Tensor], None]
    request: Callable[[int, int], None]
    receive_until: Callable[[Callable[[], bool], Callable[[], str]], None]
    has_reconnected: Callable[[int], bool]
    stage: Callable[..., bool]
    push: Callable[..., None]
    landed: Callable[[int], bool]
    advance: Callable[[Sequence[int]], None]
    release_send_buffers: Callable[[], None]


class LayerStreamer:
    """Installs the hooks that stream a model's units through a worker (see the module docstring)."""

    def __init__(
        self,
        plan: UnitPlan,
        links: StreamLinks,
        *,
        hypers: Callable[[], list[AdamWHyper]],
        sync_enabled: Callable[[], bool],
    ) -> None:
        self.plan = plan
        self._links = links
        self._state = links.state
        self.params = links.state.params
        self._hypers = hypers
        self._sync_enabled = sync_enabled
        self.stats = StreamStats()
        unit_index_of_param = [plan.unit_of[id(p)] for p in self.params]
        present = sorted(set(unit_index_of_param))
        self.units: dict[int, _Unit] = {u: _Unit(u, plan.names[u], [], []) for u in present}
        for layout_index, unit_index in enumerate(unit_index_of_param):
            self.units[unit_index].params.append(layout_index)
        self._unit_of_bucket: dict[int, _Unit] = {}
        for bucket in links.state.buckets:
            unit = self.units[unit_index_of_param[bucket.segments[0].param_index]]
            assert all(unit_index_of_param[seg.param_index] == unit.index for seg in bucket.segments), "buckets never span units"
            unit.buckets.append(bucket.bucket_id)
            self._unit_of_bucket[bucket.bucket_id] = unit
        self._unit_of_param = [self.units[u] for u in unit_index_of_param]
        self._module_units = [self.units[u] for u in present if u != 0]  # forward order
        self._position = {unit.index: position for position, unit in enumerate(self._module_units)}
        self._copier = HostToDevice(plan.device, links.state.job.bucket_numel)
        self._aliases = BoardAliases(self.params, links.state.buckets, WIRE_DTYPES[links.state.job.wire_dtype], enabled=not self._copier.cuda)
        self._grads = GradsOf(self.params)
        self._pushes = LandedPushes(links.state.buckets, stage=links.stage, push=links.push, landed=links.landed)
        self.step = 0
        self._handles: list = []
        self._hooked: set[int] = set()  # layout indices with a gradient hook
        # Parameters, frames and activations come and go every step. Below 32 MiB (glibc's largest
        # threshold) they come from the heap, where the next unit reuses what the last one freed
        # without faulting its pages in again (up to the units that may be held at once, kept mapped
        # for it). Between steps the heap keeps what a step freed for the next one, trimmed only
        # where the RSS creeps (StepHeap). Mapping every allocation of 1 MiB or more (returned to the
        # OS at once) kept the RSS 25% lower but made layer-wise steps 20-25% slower on CPU: page
        # faults on every fetch.
        sizes = {unit.index: sum(self.params[i].numel() * self.params[i].element_size() for i in unit.params) for unit in self.units.values()}
        self._first_kept, kept_bytes = kept_for_backward([sizes[u.index] for u in self._module_units], plan.prefetch, plan.keep_for_backward)
        self._heap = keep_step_heap((plan.prefetch + 2) * max(sizes.values(), default=0) + kept_bytes)

    # ---------------------------------------------------------------- setup

    @property
    def device_copy_bytes(self) -> dict[str, int]:
        """On a GPU: unit bytes copied up, ``direct`` from page-locked windows and boards, ``staged``
        through pinned buffers."""
        return self._copier.copied_bytes

    def connect(self) -> None:
        """Register the job; rank 0 sends initial values unit by unit (materializing, initializing and
        freeing each in turn, so the model is never whole here); every unit ends freed."""
        needs_init = set(self._links.hello())
        # The step the nodes say this rank is at: a restarted rank redoes the step its predecessor
        # left unfinished, fetching that step's values (kept on the nodes for it) and pushing only
        # the buckets the nodes do not have its gradient of yet.
        self.step = self._state.resume_step
        if needs_init and self._state.rank == 0:
            log.info("registering initial values of %d buckets, unit by unit", len(needs_init))
            for unit in self.units.values():
                todo = [b for b in unit.buckets if b in needs_init]
                if not todo:
                    continue
                tensors = [self.params[i] for i in unit.params]
                for tensor in tensors:
                    if tensor.untyped_storage().nbytes() == 0:
                        self._allocate(tensor)
                initialize(self.plan, tensors)
                self._measure(also=unit)
                staging = torch.empty(max(self._state.buckets[b].numel for b in todo), dtype=torch.float32)
                for bucket_id in todo:
                    values = staging[: self._state.buckets[bucket_id].numel]
                    self._gather_values(bucket_id, values)
                    self._links.send_initial(bucket_id, values)
                del staging
                for tensor in tensors:  # this unit is on the nodes now: free it before the next
                    tensor.untyped_storage().resize_(0)
        for index in self.units:
            for i in self.units[index].params:
                self.params[i].untyped_storage().resize_(0)
        trim_host_heap()
        self._links.route.handler = self._on_params
        self._install_hooks()
        log.info(
            "rank %d streams %d units (prefetch %d, %d kept for backward), the job is at step %d",
            self._state.rank,
            len(self.units),
            self.plan.prefetch,
            len(self._module_units) - self._first_kept,
            self.step,
        )

    def _gather_values(self, bucket_id: int, out: torch.Tensor) -> None:
        for seg in self._state.buckets[bucket_id].segments:
            source = self.params[seg.param_index].data.view(-1)[seg.param_offset : seg.param_offset + seg.numel]
            out[seg.bucket_offset : seg.bucket_offset + seg.numel].copy_(source)

    def _install_hooks(self) -> None:
        self._handles.append(self.plan.model.register_forward_pre_hook(lambda _module, _args: self._begin_forward()))
        for unit in self._module_units:
            module = self.plan.modules[unit.index]
            assert module is not None
            self._handles.append(module.register_forward_pre_hook(lambda _m, _a, unit=unit: self._before_forward(unit)))
            self._handles.append(module.register_forward_hook(lambda _m, _a, output, unit=unit: self._after_forward(unit, output)))
        for layout_index, param in enumerate(self.params):
            if param.requires_grad:  # a frozen parameter gets no gradient (torch refuses hooks on it)
                self._hooked.add(layout_index)
                self._handles.append(param.register_post_accumulate_grad_hook(lambda _p, i=layout_index: self._on_grad(i)))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---------------------------------------------------------------- residency

    @staticmethod
    def _allocate(param: torch.Tensor) -> None:
        param.untyped_storage().resize_(param.numel() * param.element_size())

    def _request(self, unit: _Unit) -> None:
        if unit.step == self.step and (unit.resident or unit.pending):
            return
        if self._aliases.holds(unit.index):  # values of an earlier step, read in place: let them go first
            self._release(unit)
        if self._copier.cuda:  # on CPU, where a copy is needed, on arrival (see BoardAliases)
            for i in unit.params:
                if self.params[i].untyped_storage().nbytes() == 0:
                    self._allocate(self.params[i])
        unit.resident, unit.step, unit.ready_event = True, self.step, None
        self._copier.begin()
        unit.pending = set(unit.buckets)
        unit.requested_at = time.perf_counter()
        for bucket_id in unit.buckets:
            self._links.request(bucket_id, self.step)
        self._measure()

    def _ensure(self, unit: _Unit) -> None:
        self._request(unit)
        if unit.pending:
            started = time.perf_counter()
            self._links.receive_until(lambda: not unit.pending, lambda: f"unit {unit.name!r} is missing {len(unit.pending)} bucket(s) of step {unit.step}")
            self.stats.fetch_wait_s += time.perf_counter() - started
        HostToDevice.wait(unit.ready_event)

    def _release(self, unit: _Unit) -> None:
        if not unit.resident:
            return
        if unit.pending:  # a prefetch nobody used: let it land before its storage goes
            self._links.receive_until(lambda: not unit.pending, lambda: f"unit {unit.name!r} is missing {len(unit.pending)} bucket(s)")
        if unit.ready_event is not None:
            wait_on_host(unit.ready_event)
        self._aliases.check(unit.index)
        for i in unit.params:
            if not self._aliases.release(i):
                self.params[i].untyped_storage().resize_(0)
        unit.resident = False

    def _on_params(self, node_index: int, message: Message) -> None:
        header = message.header
        unit = self._unit_of_bucket.get(header.bucket_id)
        if unit is not None and header.bucket_id not in unit.pending and header.step <= unit.step and self._links.has_reconnected(node_index):
            log.debug("node %s sent bucket %d of step %d again after a reconnect: ignored", self._state.nodes[node_index], header.bucket_id, header.step)
            return  # asked for again after a reconnect while the first answer was on its way: the values are in already
        if unit is None or header.bucket_id not in unit.pending or header.step != unit.step:
            raise RuntimeError(f"node {self._state.nodes[node_index]} sent bucket {header.bucket_id} at step {header.step}, which this worker did not ask for")
        bucket = self._state.buckets[header.bucket_id]
        if header.numel != bucket.numel or header.dtype != self._state.job.wire_dtype:
            raise RuntimeError(f"node {self._state.nodes[node_index]} sent bucket {bucket.bucket_id} as {header.numel} x {header.dtype}")
        segments = self._aliases.install(bucket, message, unit.step)  # on CPU, read in place where it can be
        if not self._copier.cuda:  # the rest is copied, into storage allocated now (on a GPU, at the request)
            for seg in segments:
                self._aliases.will_copy(seg.param_index, unit.step)
                if self.params[seg.param_index].untyped_storage().nbytes() == 0:
                    self._allocate(self.params[seg.param_index])
        for chunk_offset, view in message.tensors:
            chunk_end = chunk_offset + view.numel()
            for seg in segments:
                low, high = max(seg.bucket_offset, chunk_offset), min(seg.bucket_offset + seg.numel, chunk_end)
                if low < high:
                    start = seg.param_offset + low - seg.bucket_offset
                    target = self.params[seg.param_index].data.view(-1)[start : start + high - low]
                    self._copier.copy(target, view[low - chunk_offset : high - chunk_offset])
        if len(segments) < len(bucket.segments):  # read in place until the unit is pushed or let go, checked then
            self._aliases.hold(unit.index, message, self._state.nodes[node_index])
        elif not self._copier.cuda:  # copied already: from a node's board, the values must still be the ones sent
            finish_board_read(message, self._state.nodes[node_index])
        self.stats.fetched_bytes += header.payload_bytes
        unit.pending.discard(bucket.bucket_id)
        if not unit.pending:
            unit.ready_event = self._copier.record()
            self.stats.fetches += 1
            self.stats.fetch_transfer_s += time.perf_counter() - unit.requested_at

    def _measure(self, also: _Unit | None = None) -> None:
        # At every hook: the held units' parameters only (and ``also``'s), not a scan of the model's.
        held = [i for unit in self.units.values() if unit.resident or unit is also for i in unit.params]
        self.stats.peak_param_bytes = max(self.stats.peak_param_bytes, self._param_bytes(held))

    def resident_param_bytes(self) -> int:
        """Parameter bytes this worker holds right now, read from every parameter's storage."""
        return self._param_bytes(range(len(self.params)))

    def _param_bytes(self, indices: Iterable[int]) -> int:
        """The bytes of the storages of these parameters, each counted once (a parameter that is a
        view of a board counts its own bytes, not the board's)."""
        aliased = self._aliases.viewing
        own: dict[int, int] = {}
        viewed = 0
        for i in indices:
            param = self.params[i]
            if i in aliased:
                viewed += param.numel() * param.element_size()
            else:
                storage = param.untyped_storage()
                own[storage.data_ptr()] = storage.nbytes()
        return sum(own.values()) + viewed

    # ---------------------------------------------------------------- hooks

    def _prefetch(self, after: int, direction: int) -> None:
        for distance in range(1, self.plan.prefetch + 1):
            position = after + direction * distance
            if 0 <= position < len(self._module_units):
                self._request(self._module_units[position])

    def _begin_forward(self) -> None:
        if _in_backward():
            return
        if 0 in self.units:
            self._ensure(self.units[0])
        if self._module_units:
            self._prefetch(-1, +1)

    def _before_forward(self, unit: _Unit) -> None:
        self._ensure(unit)
        if not _in_backward():
            self._prefetch(self._position[unit.index], +1)
        self._measure()

    def _after_forward(self, unit: _Unit, output: object) -> None:
        if _in_backward():  # activation checkpointing recomputes inside backward: keep the unit
            return
        needs_backward = torch.is_grad_enabled()
        if needs_backward:
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda _grad, unit=unit: self._before_backward(unit))
        # The last units forward runs are the first backward needs: those that stay are not fetched again.
        kept_for_backward = self._position[unit.index] >= self._first_kept
        if not (needs_backward and kept_for_backward):
            self._release(unit)
        self._measure()

    def _before_backward(self, unit: _Unit) -> None:
        self._pushes.send_landed()
        self._ensure(unit)
        self._prefetch(self._position[unit.index], -1)
        self._measure()

    def _on_grad(self, layout_index: int) -> None:
        if self._pushes:
            self._pushes.send_landed()
        unit = self._unit_of_param[layout_index]
        unit.grads_ready.add(layout_index)
        # Ready once every parameter of the unit that trains now has its gradient; a parameter unfrozen
        # after the hooks were made has no hook, so its unit waits for step(). Worked out once a step:
        # a hook per parameter must not scan the unit.
        if unit.waits_for is None:
            trainable = [i for i in unit.params if self.params[i].requires_grad]
            unit.waits_for = len(trainable) if all(i in self._hooked for i in trainable) else -1
        if len(unit.grads_ready) != unit.waits_for:
            return
        unit.grads_ready.clear()
        self._aliases.check(unit.index)  # before the push, after which the node may rewrite the board
        if self._sync_enabled():  # else gradients accumulate locally (no_sync); the unit is freed all the same
            self._push(unit)
        self._release(unit)
        self._measure()

    def _push(self, unit: _Unit) -> None:
        hypers = self._hypers()
        for bucket_id in unit.buckets:  # the copies start now; each bucket goes once its copy landed
            self._pushes.push(bucket_id, self._grads, hypers)
        self._pushes.send_landed()
        for i in unit.params:
            self.params[i].grad = None
        unit.pushed = True

    # ---------------------------------------------------------------- step

    def finish_step(self) -> None:
        """Push what backward did not, free every unit and move to the next step (no waiting)."""
        for unit in self.units.values():
            if not unit.pushed:
                self._aliases.check(unit.index)
                self._push(unit)
            self._release(unit)
            unit.pushed = False
            unit.grads_ready.clear()
            unit.waits_for = None
        self._pushes.send_all()
        self._links.advance([b.bucket_id for b in self._state.buckets])
        self._links.release_send_buffers()
        self._heap.step_done()
        self.step += 1

    def gather(self) -> dict[str, torch.Tensor]:
        """The current values of every streamed parameter (fetched unit by unit, copied to the CPU):
        waits for the nodes to apply the last step."""
        values: dict[str, torch.Tensor] = {}
        for unit in self.units.values():
            self._ensure(unit)
            for i in unit.params:
                values[self._state.job.params[i].name] = self.params[i].detach().to("cpu", copy=True)
            self._release(unit)
        trim_host_heap()
        return values
