"""Your own Hugging Face causal LM, layer-wise: from a model directory to a model and its optimizer
in one call, the model never whole on the worker (:func:`offload_causal_lm`).

The model is built from its config with its parameters on the meta device (its buffers, such as the
rotary embedding's frequencies, are made as usual: they are small and computed, not trained). The
decoder layers become the streamed units, everything else (embeddings, final norm, head, tied
weights once) the root unit. Rank 0 fills each unit's parameters from the directory's safetensors
shards as it first needs them, a tensor at a time from memory-mapped files, and sends them to the
nodes that own them: no process holds the whole model. bf16 and fp16 shards become fp32 masters.

Every tensor the model needs is checked against the shards' headers before anything is sent: a
missing tensor, a shape that does not match the config, or a shard that cannot be read stops with a
message naming the tensor and the file, before any node holds a partial model.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpu_worker import RemoteAdamW, offload
from netoptim.integrations._extras import require

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Where the decoder layers are in the families named by the docs (Llama, Mistral, Qwen2 and Phi keep
# them at model.layers, GPT-2 at transformer.h, GPT-NeoX at gpt_neox.layers).
_LAYER_PATHS = ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers")


class PretrainedWeightsError(ValueError):
    """The shards cannot give the model its values; the message names the tensor and the file."""


class PretrainedWeights:
    """A model directory's safetensors shards, read a tensor at a time (memory-mapped).

    ``directory``: holds ``model.safetensors`` or ``model.safetensors.index.json`` and its shards.
    :meth:`check` holds a model's parameters against the shards' headers; :meth:`initializer` is
    the ``init_fn(name, tensor)`` that fills a parameter from them.
    """

    def __init__(self, directory: str | Path) -> None:
        require("safetensors", by=__name__)
        from safetensors import SafetensorError, safe_open

        self._open = safe_open
        self._errors = (OSError, RuntimeError, ValueError, SafetensorError)  # what a damaged or missing shard raises
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise PretrainedWeightsError(f"{index}: not a readable safetensors index ({exc})") from exc
            self.file_of = {name: self.directory / file for name, file in weight_map.items()}
        elif (self.directory / SINGLE_FILE).is_file():
            self.file_of = {name: self.directory / SINGLE_FILE for name in self._header(self.directory / SINGLE_FILE)}
        else:
            raise PretrainedWeightsError(f"{self.directory}: neither {SINGLE_FILE} nor {INDEX_FILE}: not a model directory with safetensors weights")
        self._shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.file_of.values())):
            for name, shape in self._header(file).items():
                self._shapes[name] = shape

    def _header(self, file: Path) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape in ``file``, from its header; the file's size checked against it."""
        try:
            with self._open(str(file), framework="pt") as handle:
                return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
        except self._errors as exc:
            raise PretrainedWeightsError(f"{file}: the shard cannot be read ({exc})") from exc

    def check(self, wanted: Mapping[str, tuple[int, ...]]) -> None:
        """Every tensor of ``wanted`` (name -> shape) is in a readable shard with that shape."""
        for name, shape in wanted.items():
            file = self.file_of.get(name)
            if file is None:
                raise PretrainedWeightsError(f"{name}: no shard of {self.directory} holds it (the model of this config needs it)")
            if name not in self._shapes:
                raise PretrainedWeightsError(f"{name}: the index names {file.name}, which does not hold it")
            if self._shapes[name] != shape:
                raise PretrainedWeightsError(f"{name} in {file}: shape {list(self._shapes[name])}, the config's model needs {list(shape)}")

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name``, read from its memory-mapped shard (only its bytes)."""
        file = self.file_of[name]
        try:
            with self._open(str(file), framework="pt") as handle:
                return handle.get_tensor(name)
        except self._errors as exc:
            raise PretrainedWeightsError(f"{name} in {file}: cannot be read ({exc})") from exc

    def initializer(self) -> Any:
        """``init_fn(name, tensor)``: the parameter's values from the shards, as the tensor's dtype."""

        def init(name: str, tensor: torch.Tensor) -> None:
            tensor.copy_(self.read(name))

        return init


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within it, a module's parameters are put on the meta device as they are registered (their
    initialization then costs nothing); buffers stay where they are made."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers: at a known place for the families in the docs, else its largest
    ``nn.ModuleList``; ``ValueError`` where it has none."""
    for path in _LAYER_PATHS:
        found: Any = model
        for part in path.split("."):
            found = getattr(found, part, None)
        if isinstance(found, nn.ModuleList) and len(found):
            return found
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of layers: pass layers= yourself")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def offload_causal_lm(
    directory: str | Path,
    *,
    nodes: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
    lr: float = 1e-5,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    wire_dtype: torch.dtype = torch.float32,
    max_grad_norm: float | None = None,
    bucket_numel: int | None = None,
    curve_secret_key: str | None = None,
    curve_server_key: str | None = None,
    prefetch: int = 1,
    keep_for_backward: int = 0,
    device: torch.device | str | None = None,
    gradient_checkpointing: bool = False,
    layers: Sequence[nn.Module] | None = None,
    moments: str = "fp32",
    moment_block: int = 256,
    timeout_s: float = 300.0,
) -> tuple[nn.Module, RemoteAdamW]:
    """A Hugging Face causal LM from ``directory`` (its config and safetensors shards), layer-wise on
    the nodes, and its optimizer (see the module docstring).

    Args:
        directory: a model directory as ``save_pretrained`` writes it.
        nodes, rank, world_size, lr, betas, eps, weight_decay, wire_dtype, max_grad_norm, bucket_numel, curve_secret_key, curve_server_key, moments, moment_block, timeout_s: as for :class:`~gpu_worker.RemoteAdamW` (``moments="8bit"``: a quarter of fp32's bytes of moments on the nodes).
        prefetch, keep_for_backward, device: as for :func:`~gpu_worker.offload`.
        gradient_checkpointing: Hugging Face's gradient checkpointing (recompute each layer's
            activations in backward, where the layer is fetched anyway).
        layers: the units to stream; default: the model's decoder layers (:func:`decoder_layers`).

    Returns the model (its KV cache off: training has no use for it) and the optimizer, already
    registered: train with ``model(input_ids=..., labels=...).loss.backward(); optimizer.step()``.
    Raises :class:`PretrainedWeightsError` (before anything reaches a node) where the shards cannot
    give every parameter its values.
    """
    transformers = require("transformers", by=__name__)
    directory = Path(directory)
    config = transformers.AutoConfig.from_pretrained(str(directory))
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.float()  # fp32 parameters whatever the shards' dtype: the nodes' masters are fp32 (on meta: nothing moves)
    model.config.use_cache = False
    weights = PretrainedWeights(directory)
    weights.check({name: tuple(p.shape) for name, p in model.named_parameters()})  # tied weights once
    if gradient_checkpointing:  # transformers 5 renamed it; 4.x has the older name only
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    units = list(layers) if layers is not None else list(decoder_layers(model))
    log.info("%s: %d layer units, %s parameters", directory, len(units), f"{sum(p.numel() for p in model.parameters()):,}")
    model.train()
    optimizer = offload(
        model,
        units,
        nodes=nodes,
        rank=rank,
        world_size=world_size,
        init_fn=weights.initializer(),
        prefetch=prefetch,
        keep_for_backward=keep_for_backward,
        device=device,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        wire_dtype=wire_dtype,
        max_grad_norm=max_grad_norm,
        bucket_numel=bucket_numel,
        curve_secret_key=curve_secret_key,
        curve_server_key=curve_server_key,
        moments=moments,
        moment_block=moment_block,
        timeout_s=timeout_s,
        # a causal LM's buffers (rotary frequencies, masks) follow from its config, the same on every
        # rank: nothing to broadcast, and no process group needed for it
        broadcast_buffers=False,
    )
    return model, optimizer


__all__ = ["PretrainedWeights", "PretrainedWeightsError", "decoder_layers", "offload_causal_lm", "parameters_on_meta"]
