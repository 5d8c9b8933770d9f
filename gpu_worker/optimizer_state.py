"""A remote optimizer's state in the format of torch's optimizer of the same rule (AdamW, Adam, SGD;
Lion as its reference keeps it), gathered from the nodes and pushed back.

torch's ``AdamW.state_dict()`` holds, per parameter index (over the param groups, in order), ``step``
(a 0-d fp32 tensor), ``exp_avg`` and ``exp_avg_sq`` (shaped like the parameter), and no entry for a
parameter never stepped (here: step 0 and zeros, the same to torch, and what
``torch.distributed.checkpoint`` needs to load into). The nodes hold the same per bucket segment, fp32; these functions cut and
join them, so a run moves from torch to netoptim and back and continues bit for bit. A state dict
whose moments are a quantized tensor subclass (torchao's 8-bit AdamW keeps ``OptimState8bit``) loads
too, its moments dequantized.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gpu_worker.links.rank_state import RankState

ReadState = Callable[[int, str], tuple[torch.Tensor, list[float]]]
"""``read_state(bucket_id, part)``: one part of a bucket's optimizer state on its node, and its segments' step counts."""

WriteState = Callable[[int, str, torch.Tensor, "list[float] | None"], None]
"""``write_state(bucket_id, part, values, segment_steps)``: rank 0 replaces one part of a bucket's optimizer state."""

STATE_KEYS: dict[str, tuple[tuple[tuple[str, str], ...], bool]] = {
    "adamw": ((("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")), True),
    "adam": ((("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")), True),
    "sgd": ((("momentum_buffer", "exp_avg"),), False),
    "sgd-nesterov": ((("momentum_buffer", "exp_avg"),), False),
    "lion": ((("exp_avg", "exp_avg"),), False),
}
"""Per rule: (torch's state key, the node's part) for each moment, and whether torch keeps ``step``.
A rule without ``step`` in torch still has one on the node (SGD's first step starts its buffer)."""


class NodeHeldState(collections.defaultdict):
    """``optimizer.state`` of a remote optimizer: empty on the worker (the state is on the nodes) but
    true, because tools take an empty state for one not made yet and make it by running a step with
    zero gradients and a zero learning rate (``torch.distributed.checkpoint.state_dict``): on the
    nodes that step would count, and decay the moments."""

    def __bool__(self) -> bool:
        return True


def torch_indices(param_groups: Sequence[dict[str, Any]]) -> dict[int, int]:
    """Each parameter's index in torch's state dict: its place over the param groups, in order."""
    return {id(p): i for i, p in enumerate(p for group in param_groups for p in group["params"])}


def with_node_state(
    state: dict[str, Any],
    rank_state: RankState,
    read_state: ReadState,
    params: Sequence[torch.Tensor],
    param_groups: Sequence[dict[str, Any]],
    group_keys: dict[str, Any],
) -> dict[str, Any]:
    """A remote optimizer's ``state_dict()``: torch's (``state``: the param groups, no per-parameter
    state) completed with what torch's optimizer of the rule keeps in each group (``group_keys``), the
    state gathered from the nodes, and under ``"netoptim"`` the nodes, their step and the world size.
    Between steps (the last update applied); ``rank_state``: the job's buckets and the nodes' step."""
    for group in state["param_groups"]:  # torch AdamW's own keys; the nodes run its fused kernel, so a torch run resumed from here uses it too
        for key, value in group_keys.items():
            group.setdefault(key, value)
    state["state"] = gather_state(rank_state, read_state, params, torch_indices(param_groups))
    state["netoptim"] = {
        "state_location": "optimizer_nodes",
        "nodes": list(rank_state.nodes),
        "step": rank_state.step,
        "world_size": rank_state.job.world_size,
    }
    return state


def entries_to_load(
    state_dict: dict[str, Any], rule: str, params: Sequence[torch.Tensor], param_groups: Sequence[dict[str, Any]]
) -> tuple[dict[str, Any], list[dict[str, Any] | None]]:
    """A state dict given to a remote optimizer's ``load_state_dict()``, checked before anything
    changes: a copy without the ``"netoptim"`` section, and each parameter's entry of its state
    (:func:`state_entries`; ``params`` in the layout's order, ``param_groups`` the optimizer's)."""
    state_dict = dict(state_dict)
    state_dict.pop("netoptim", None)
    for group in state_dict.get("param_groups", []):
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError("the state dict's param groups use amsgrad or maximize, which RemoteAdamW does not support")
    moments = state_dict.get("state", {})
    # The state's keys, as torch reads them: the saved groups' "params" (indices, or parameter
    # names from torch.distributed.checkpoint), in the order of this optimizer's groups.
    saved_groups = state_dict.get("param_groups", [])
    key_of = {id(p): key for saved, group in zip(saved_groups, param_groups, strict=False) for key, p in zip(saved["params"], group["params"], strict=False)}
    return state_dict, state_entries(rule, params, key_of, moments)


def gather_state(rank_state: RankState, read_state: ReadState, params: Sequence[torch.Tensor], index_of: dict[int, int]) -> dict[int, dict[str, Any]]:
    """torch's per-parameter state (keyed by ``index_of[id(param)]``) from the nodes' buckets (``rank_state``'s)."""
    keys, with_step = STATE_KEYS[rank_state.job.rule]
    parts = [part for _, part in keys]
    flat = {part: [torch.zeros(p.numel(), dtype=torch.float32) for p in params] for part in parts}
    steps: list[float | None] = [None] * len(params)
    for bucket in rank_state.buckets:
        for part in parts:
            values, segment_steps = read_state(bucket.bucket_id, part)
            for seg, count in zip(bucket.segments, segment_steps, strict=True):
                flat[part][seg.param_index][seg.param_offset : seg.param_offset + seg.numel] = values[seg.bucket_offset : seg.bucket_offset + seg.numel]
                if steps[seg.param_index] not in (None, count):
                    raise RuntimeError(
                        f"the nodes hold parameter {rank_state.job.params[seg.param_index].name!r} at two step counts ({steps[seg.param_index]}, {count})"
                    )
                steps[seg.param_index] = count
    state: dict[int, dict[str, Any]] = {}
    for i, param in enumerate(params):
        if not steps[i] and not with_step:
            continue  # never stepped: torch has no state for it (SGD takes a present momentum buffer for a past first step)
        # A rule with a step count gets an entry for a parameter never stepped too: step 0 and zero moments,
        # which torch takes exactly as no entry; torch.distributed.checkpoint needs every entry to load into.
        entry: dict[str, Any] = {"step": torch.tensor(steps[i], dtype=torch.float32)} if with_step else {}
        entry.update({key: flat[part][i].view(param.shape).to(device=param.device, dtype=param.dtype) for key, part in keys})
        state[index_of[id(param)]] = entry
    return state


def plain_tensor(value: Any) -> Any:
    """``value`` as a plain fp32 tensor when it is a quantized tensor subclass with its own
    ``dequantize()`` (torchao's ``OptimState8bit``, as its 8-bit optimizers keep the moments), else
    ``value`` itself. Recognized by its method, so this package needs no torchao: a plain
    ``torch.Tensor`` (whose ``dequantize`` is for torch's quantized dtypes), a ``Parameter`` or
    another subclass without a ``dequantize`` of its own is left as it is."""
    if not torch.is_tensor(value) or type(value) is torch.Tensor:
        return value
    if getattr(type(value), "dequantize", torch.Tensor.dequantize) is torch.Tensor.dequantize:
        return value
    return value.dequantize().to(torch.float32)


def state_entries(rule: str, params: Sequence[torch.Tensor], key_of: dict[int, Any], state: dict[Any, dict[str, Any]]) -> list[dict[str, Any] | None]:
    """Each parameter's entry of torch's per-parameter ``state`` (None: none), checked against the
    rule's keys and the parameters' shapes (``ValueError`` naming the first that does not fit).
    ``key_of[id(param)]`` is the parameter's key in ``state`` (an index, or a name from
    ``torch.distributed.checkpoint``). Moments kept as a quantized tensor subclass (torchao's 8-bit
    optimizers) come back dequantized to fp32 (:func:`plain_tensor`): the nodes take fp32 and round
    it to the job's format. Every rank checks, so a bad dict fails everywhere alike."""
    keys, with_step = STATE_KEYS[rule]
    entries: list[dict[str, Any] | None] = []
    for param in params:
        entry = state.get(key_of.get(id(param)))
        if entry is not None:
            entry = {key: plain_tensor(value) for key, value in entry.items()}
            missing = [key for key in (("step",) if with_step else ()) + tuple(key for key, _ in keys) if key not in entry]
            if missing:
                raise ValueError(f"the state of parameter {key_of.get(id(param))} has no {missing}: is it a state dict of torch's {rule} optimizer?")
            for key, _ in keys:
                if tuple(entry[key].shape) != tuple(param.shape):
                    raise ValueError(f"{key} of parameter {key_of.get(id(param))} has shape {tuple(entry[key].shape)}, the parameter {tuple(param.shape)}")
        entries.append(entry)
    return entries


def load_state(
    rank_state: RankState, write_state: WriteState, params: Sequence[torch.Tensor], entries: Sequence[dict[str, Any] | None], *, with_params: bool
) -> None:
    """Rank 0: every bucket's moments and step counts from the parameters' checked ``entries``
    (:func:`state_entries`; a parameter without one starts at zero, as in torch). With
    ``with_params``, the parameters' current values become the nodes' fp32 masters too. Each bucket
    of ``rank_state`` goes through ``write_state``."""
    keys, with_step = STATE_KEYS[rank_state.job.rule]
    part_key = {part: key for key, part in keys}

    def step_of(entry: dict[str, Any] | None) -> float:
        if entry is None:
            return 0.0  # as torch: no state yet, the first step starts it
        return float(entry["step"]) if with_step else 1.0  # a rule torch keeps no step for: past its first step

    for bucket in rank_state.buckets:
        segment_steps = [step_of(entries[seg.param_index]) for seg in bucket.segments]
        parts = [*part_key, "param"] if with_params else list(part_key)
        for part in parts:
            values = torch.zeros(bucket.numel, dtype=torch.float32)
            for seg in bucket.segments:
                entry = entries[seg.param_index]
                source = params[seg.param_index] if part == "param" else (None if entry is None else entry[part_key[part]])
                if source is not None:
                    flat = source.detach().reshape(-1)[seg.param_offset : seg.param_offset + seg.numel]
                    values[seg.bucket_offset : seg.bucket_offset + seg.numel] = flat.to(device="cpu", dtype=torch.float32)
            write_state(bucket.bucket_id, part, values, segment_steps if part == "exp_avg" else None)  # every rule has exp_avg
