"""How a model splits into the units that layer-wise mode streams, and what a worker holds of them.

A *unit* is a module named by the user (typically each transformer block); its parameters are fetched
from the optimizer nodes before its forward and again before its backward, and freed after each.
The *root unit* holds every other trainable parameter (embeddings, final norm, head) and every
parameter reachable from more than one unit (tied weights): it is fetched at the start of the
forward pass and freed once its gradients have been pushed. Units never nest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gpu_worker.layerwise.device_copy import canonical_device

log = logging.getLogger(__name__)

ROOT_UNIT = "<root>"
InitFn = Callable[[str, torch.Tensor], None]
"""``init_fn(parameter_name, tensor)`` fills a freshly materialized parameter in place."""


@dataclass(frozen=True)
class UnitPlan:
    """The units of a model in forward order (the root unit first) and which parameter is whose."""

    model: nn.Module
    names: tuple[str, ...]  # unit names; names[0] is ROOT_UNIT
    modules: tuple[nn.Module | None, ...]  # None for the root unit
    unit_of: dict[int, int]  # id(parameter) -> unit index
    param_names: dict[int, str]  # id(parameter) -> its name in the model
    needs_init: frozenset[int]  # ids of parameters that were on the meta device
    prefetch: int
    init_fn: InitFn | None
    device: torch.device
    keep_for_backward: int = 0  # parameter bytes of the last units that stay from forward to backward (see offload())

    def order(self, params: Sequence[torch.Tensor]) -> tuple[list[int], list[int]]:
        """A permutation of ``params`` that groups them by unit (forward order, stable within a
        unit), and the index in the permuted list where each non-empty unit starts."""
        for param in params:
            if id(param) not in self.unit_of:
                raise ValueError("the optimizer was given a parameter that is not in the offloaded model")
        order = sorted(range(len(params)), key=lambda i: self.unit_of[id(params[i])])
        starts = [
            position
            for position, index in enumerate(order)
            if position == 0 or self.unit_of[id(params[order[position - 1]])] != self.unit_of[id(params[index])]
        ]
        return order, starts


def _empty_like_on(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of ``param``'s shape and dtype on ``device`` whose storage holds no bytes."""
    tensor = torch.empty(0, dtype=param.dtype, device=device)
    strides = torch.empty(param.shape, device="meta").stride()
    tensor.set_(tensor.untyped_storage(), 0, param.shape, strides)
    tensor.untyped_storage().resize_(0)
    return tensor


def _materialize_meta(model: nn.Module, device: torch.device) -> set[int]:
    """Replace every meta parameter by an empty one on ``device`` (tied parameters stay tied)."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            new = replaced.get(id(param))
            if new is None:
                new = nn.Parameter(_empty_like_on(param, device), requires_grad=param.requires_grad)
                replaced[id(param)] = new
            module._parameters[name] = new
    return {id(p) for p in replaced.values()}


def plan_units(
    model: nn.Module,
    units: Sequence[nn.Module] | nn.ModuleList,
    *,
    prefetch: int = 1,
    init_fn: InitFn | None = None,
    device: torch.device | str | None = None,
    keep_for_backward: int = 0,
) -> UnitPlan:
    """Check ``units`` against ``model`` and make the plan; meta parameters are replaced by empty
    ones on ``device`` here (build the optimizer's param groups after this). ``ValueError`` for a
    module that cannot be streamed as asked."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be a non-negative integer (units fetched ahead of the one computing), got {prefetch!r}")
    if isinstance(keep_for_backward, bool) or not isinstance(keep_for_backward, int) or keep_for_backward < 0:
        raise ValueError(f"keep_for_backward must be a non-negative integer (bytes of parameters kept from forward to backward), got {keep_for_backward!r}")
    units = list(units)
    if not units:
        raise ValueError("layer-wise mode needs at least one unit (for example units=model.blocks)")
    module_names = {id(m): name for name, m in model.named_modules()}
    seen: set[int] = set()
    for unit in units:
        if not isinstance(unit, nn.Module):
            raise TypeError(f"units must be modules of the model, got {type(unit).__name__}")
        if unit is model:
            raise ValueError("the whole model cannot be a unit: name its blocks (for example units=model.blocks), or use full-model mode")
        if id(unit) not in module_names:
            raise ValueError(f"unit {type(unit).__name__} is not a submodule of the model")
        if id(unit) in seen:
            raise ValueError(f"unit {module_names[id(unit)]!r} is listed twice")
        seen.add(id(unit))
    for unit in units:
        for inner in unit.modules():
            if inner is not unit and id(inner) in seen:
                raise ValueError(f"unit {module_names[id(inner)]!r} is inside unit {module_names[id(unit)]!r}: units cannot nest")
    any_meta = any(p.is_meta for p in model.parameters())
    if device is None:
        real = [p.device for p in model.parameters() if not p.is_meta]
        device = real[0] if real else torch.device("cpu")
    device = canonical_device(device)  # "cuda" and "cuda:0" alike
    needs_init = _materialize_meta(model, device) if any_meta else set()
    for name, param in model.named_parameters():
        if canonical_device(param.device) != device:
            raise ValueError(f"parameter {name!r} is on {param.device}, the others on {device}: move the model to one device first")

    owners: dict[int, set[int]] = {}
    param_names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        param_names.setdefault(id(param), name)
        owners.setdefault(id(param), set())
    for index, unit in enumerate(units, start=1):
        for param in unit.parameters():
            owners[id(param)].add(index)
    # A parameter used inside one unit only belongs to it; one also reachable from outside (tied
    # embedding and head) or from two units goes to the root unit, which lives for the whole step.
    outside = {id(p) for name, p in model.named_parameters(remove_duplicate=False) if not any(name.startswith(module_names[id(u)] + ".") for u in units)}
    unit_of: dict[int, int] = {}
    for pid, owned_by in owners.items():
        unit_of[pid] = next(iter(owned_by)) if len(owned_by) == 1 and pid not in outside else 0
        if len(owned_by) > 1 or (owned_by and pid in outside):
            log.info("parameter %r is shared between units: it lives in the root unit for the whole step", param_names[pid])
    for index, unit in enumerate(units, start=1):
        if not any(unit_of[id(p)] == index and p.requires_grad for p in unit.parameters()):
            raise ValueError(f"unit {module_names[id(unit)]!r} has no trainable parameters of its own to stream")
    if needs_init and init_fn is None:
        missing = [param_names[pid] for pid in needs_init if not _has_reset(model, pid)]
        if missing:
            raise ValueError(f"the model is on the meta device and {missing[:3]} have no reset_parameters(): pass init_fn(name, tensor)")
    return UnitPlan(
        model=model,
        names=(ROOT_UNIT, *(module_names[id(u)] for u in units)),
        modules=(None, *units),
        unit_of=unit_of,
        param_names=param_names,
        needs_init=frozenset(needs_init),
        prefetch=prefetch,
        init_fn=init_fn,
        device=device,
        keep_for_backward=keep_for_backward,
    )


def _has_reset(model: nn.Module, param_id: int) -> bool:
    return any(hasattr(m, "reset_parameters") for m in model.modules() if any(id(p) == param_id for p in m._parameters.values() if p is not None))


def initialize(plan: UnitPlan, params: Sequence[torch.Tensor]) -> None:
    """Fill the meta-born parameters among ``params`` (their storage already allocated), with
    ``init_fn`` or else their modules' ``reset_parameters()``."""
    todo = [p for p in params if id(p) in plan.needs_init]
    if not todo:
        return
    with torch.no_grad():
        if plan.init_fn is not None:
            for param in todo:
                plan.init_fn(plan.param_names[id(param)], param.data)
            return
        wanted = {id(p) for p in todo}
        for module in plan.model.modules():
            own = [p for p in module._parameters.values() if p is not None]
            if own and all(id(p) in wanted for p in own) and hasattr(module, "reset_parameters"):
                module.reset_parameters()


def kept_for_backward(unit_bytes: list[int], prefetch: int, keep_bytes: int) -> tuple[int, int]:
    """The position (forward order) of the first unit that stays from forward to backward, and the
    bytes that stay: the last ``prefetch + 1`` units (no more than forward held at once), and before
    them as many more, counting back from the last, as fit ``keep_bytes`` with them."""
    first = max(0, len(unit_bytes) - (prefetch + 1))
    kept = sum(unit_bytes[first:])
    while first > 0 and kept + unit_bytes[first - 1] <= keep_bytes:
        first -= 1
        kept += unit_bytes[first]
    return first, kept
