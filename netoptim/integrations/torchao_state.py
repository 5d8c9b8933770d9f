"""netoptim's optimizer state in the layout of torchao's 8-bit Adam, so a run moves from the nodes to
``torchao.optim.AdamW8bit`` (or ``Adam8bit``) and trains on::

    state = opt.state_dict()  # RemoteAdamW or RemoteAdam, any ``moments`` format
    params = [p for group in opt.param_groups for p in group["params"]]
    torchao_opt = torchao.optim.AdamW8bit(model.parameters(), lr=3e-4)
    torchao_opt.load_state_dict(to_torchao_8bit(state, params))

torchao keeps ``exp_avg`` and ``exp_avg_sq`` of a parameter with at least 4,096 elements and a
whole number of blocks as ``OptimState8bit`` (8-bit codes, an fp32 absmax scale per block, its
dynamic map: signed for the first moment, unsigned for the second), the rest fp32, and each param
group's ``lr`` as a tensor. :func:`to_torchao_8bit` gives exactly that, its codes from torchao's
own quantization of the fp32 moments ``state_dict()`` gives.

The other way needs no conversion: ``RemoteAdamW.load_state_dict(torchao_opt.state_dict())``
dequantizes the ``OptimState8bit`` moments to fp32, and the nodes round them to the job's format.

Exactness. With ``moments="8bit"`` on the nodes and the same block size (``moment_block``, 256 by
default), each way quantizes the moments again from decoded values (torchao's ``copy_`` here, the
node's encoder on a load, the same arithmetic). A block whose largest magnitude is a
positive value decoded to its scale itself (the map's top, 1.0), so its scale and codes come back:
it is bitwise, as is every ``exp_avg_sq`` block (unsigned map) and every fp32 moment. The signed
map's lowest value is about -0.993, not -1, so an ``exp_avg`` block whose largest magnitude is
negative decodes to an absmax 0.993 times its scale, and quantizing it again takes that smaller
scale: its values come back within one step of the map (0.7% smaller where the code stays, as almost
every code does), the loss torchao's own step takes each time it stores such a block. Loaded into
fp32 moments on the nodes, torchao's dequantized moments are kept bitwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gpu_worker.optimizer_state import plain_tensor
from netoptim.integrations._extras import require

TORCHAO_MIN_NUMEL = 4096
"""torchao's 8-bit optimizers quantize a parameter's moments from this many elements (as bitsandbytes)."""

MOMENT_SIGNED = {"exp_avg": True, "exp_avg_sq": False}
"""torchao's map for each moment: signed for the first, unsigned for the second."""


def quantized_by_torchao(numel: int, block_size: int) -> bool:
    """Whether torchao's 8-bit Adam keeps a parameter of ``numel`` elements in 8 bits (at least
    :data:`TORCHAO_MIN_NUMEL` elements and a whole number of blocks), rather than fp32."""
    return numel >= TORCHAO_MIN_NUMEL and numel % block_size == 0


def to_torchao_8bit(state_dict: Mapping[str, Any], params: Sequence[torch.Tensor], block_size: int = 256) -> dict[str, Any]:
    """``state_dict`` (of a remote AdamW or Adam, or of torch's) in the layout of torchao's
    ``AdamW8bit``/``Adam8bit`` with ``block_size``, for their ``load_state_dict()``.

    ``params`` are the parameters in the state dict's order (over its param groups, as
    ``[p for g in opt.param_groups for p in g["params"]]``). Each entry of a parameter torchao
    quantizes (:func:`quantized_by_torchao`) gets ``exp_avg`` and ``exp_avg_sq`` as
    ``OptimState8bit`` (signed and unsigned map), filled by torchao's own quantization of the fp32
    values, on the parameter's device; the other entries and every ``step`` are kept as they are.
    The param groups are kept, each ``lr`` as the fp32 tensor torchao's step requires; the
    ``"netoptim"`` section (where the state was held) is left out. The given dict is not changed.

    Raises ``TypeError`` for a state dict that is not a mapping or a ``block_size`` that is not an
    int, ``ValueError`` for one without ``state`` and ``param_groups``, a parameter count or moment
    shape that does not fit ``params``, an entry without AdamW's keys, or a ``block_size`` under 1,
    and ``ImportError`` (with the install command) where torchao is missing.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be an optimizer's state dict (a mapping), not {type(state_dict).__name__}")
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, not {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    if "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("state_dict has no 'state' and 'param_groups': is it an optimizer's state_dict()?")
    state8bit = require("torchao.optim.subclass_8bit", by="netoptim.integrations.torchao_state").OptimState8bit

    keys = [key for group in state_dict["param_groups"] for key in group["params"]]
    params = list(params)
    if len(keys) != len(params):
        raise ValueError(f"the state dict's param groups hold {len(keys)} parameters, params has {len(params)}")
    state: dict[Any, dict[str, Any]] = {}
    for key, param in zip(keys, params, strict=True):
        entry = state_dict["state"].get(key)
        if entry is None:
            continue  # never stepped: torchao starts its state at the first step, as torch
        missing = [name for name in ("step", *MOMENT_SIGNED) if name not in entry]
        if missing:
            raise ValueError(f"the state of parameter {key!r} has no {missing}: is it a state dict of AdamW or Adam?")
        converted = dict(entry)
        for name, signed in MOMENT_SIGNED.items():
            if tuple(entry[name].shape) != tuple(param.shape):
                raise ValueError(f"{name} of parameter {key!r} has shape {tuple(entry[name].shape)}, the parameter {tuple(param.shape)}")
            if quantized_by_torchao(param.numel(), block_size):
                moment = state8bit.zeros(param.shape, signed=signed, block_size=block_size, device=param.device, dtype=param.dtype)
                # torchao's copy_ into its subclass quantizes: the block scales and codes as its step stores them
                moment.copy_(plain_tensor(entry[name]).to(device=param.device, dtype=torch.float32))
                converted[name] = moment
        state[key] = converted
    groups = []
    for group in state_dict["param_groups"]:
        # torchao's step refuses a float lr (it keeps a tensor, so a compiled step takes a new value without recompiling)
        lr = group["lr"]
        lr = lr.detach().to(torch.float32).clone() if torch.is_tensor(lr) else torch.tensor(float(lr), dtype=torch.float32)
        groups.append({**group, "lr": lr, "amsgrad": group.get("amsgrad", False)})
    return {"state": state, "param_groups": groups}
