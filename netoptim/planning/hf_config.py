"""A Hugging Face causal LM's size from its config: what ``netoptim plan-memory --hf-config`` and
``netoptim doctor --hf-config`` size a job by, without the weights and without a GPU.

``PATH`` is a model directory (with its ``config.json``) or the ``config.json`` itself. Where
``transformers`` is installed, the model is built from the config on the meta device (no memory for
its weights) and its parameters are counted, tied ones once: exact for every architecture
``transformers`` knows. Without it, the count comes from the config's fields for the families whose
shapes are fixed by them (Llama, Mistral, Qwen2, GPT-2); another family asks for ``transformers``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class HFConfigError(ValueError):
    """The config cannot be read, or says too little to size the model; the message names the file."""


@dataclass(frozen=True, slots=True)
class HFModelSize:
    """What a config says of a model's size: its trainable ``params`` (tied weights once), its
    ``model_type``, ``layers`` (decoder layers) and ``hidden`` size, and how they were counted."""

    params: int
    model_type: str
    layers: int
    hidden: int
    counted_by: str  # "transformers (meta device)" or "the config's fields"


# Families whose parameter count follows from the config's fields alone: decoder layers of attention
# (q, k, v, o; k and v at the key-value heads' width) and a gated MLP, RMS norms, untied or tied head.
_LLAMA_LIKE = {"llama", "mistral", "qwen2"}


def config_path(path: str | Path) -> Path:
    """The ``config.json`` that ``path`` names: the file itself, or the one in a model directory."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise HFConfigError(f"{file}: no such file (give a model directory with a config.json, or the config.json itself)")
    return file


def read_config(path: str | Path) -> dict[str, Any]:
    """The config's fields; :class:`HFConfigError` naming the file where it is not a JSON object."""
    file = config_path(path)
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFConfigError(f"{file}: not a readable JSON config: {exc}") from exc
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise HFConfigError(f'{file}: not a Hugging Face model config (no "model_type")')
    return config


def model_size(path: str | Path, *, use_transformers: bool | None = None) -> HFModelSize:
    """The size of the causal LM ``path``'s config describes (see the module docstring).

    ``use_transformers``: ``None`` counts with ``transformers`` where it is installed, else from the
    fields; ``True`` requires it; ``False`` counts from the fields (a family they do not fix is refused).
    """
    config = read_config(path)
    file = config_path(path)
    if use_transformers is None:
        try:
            import transformers  # noqa: F401
        except ImportError:
            use_transformers = False
        else:
            use_transformers = True
    layers, hidden = _shape(config, file)
    if use_transformers:
        return HFModelSize(_count_on_meta(file), config["model_type"], layers, hidden, "transformers (meta device)")
    return HFModelSize(_count_from_fields(config, file), config["model_type"], layers, hidden, "the config's fields")


def gpt_proxy_shape(path: str | Path) -> tuple[int, int, int]:
    """``(layers, width, heads)`` of the GPT whose blocks ``netoptim plan`` times in place of the
    config's decoder layers: the same depth, width and attention heads (a Llama-family layer's gated
    MLP of about 8/3 the width does about the GPT MLP's work; grouped key-value heads do a little less
    attention work, so the plan is slightly pessimistic there). :class:`HFConfigError` naming the file."""
    config = read_config(path)
    file = config_path(path)
    layers, hidden = _shape(config, file)
    heads = _field(config, file, "num_attention_heads", "n_head")
    if hidden % heads:
        raise HFConfigError(f"{file}: a hidden size of {hidden} is not a multiple of its {heads} attention heads")
    return layers, hidden, heads


def _field(config: dict[str, Any], file: Path, *names: str) -> int:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise HFConfigError(f"{file}: needs a positive integer {' or '.join(repr(n) for n in names)} to size the model")


def _shape(config: dict[str, Any], file: Path) -> tuple[int, int]:
    return _field(config, file, "num_hidden_layers", "n_layer"), _field(config, file, "hidden_size", "n_embd")


def _count_from_fields(config: dict[str, Any], file: Path) -> int:
    model_type = config["model_type"]
    vocab = _field(config, file, "vocab_size")
    layers, hidden = _shape(config, file)
    if model_type in _LLAMA_LIKE:
        heads = _field(config, file, "num_attention_heads")
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        inner = _field(config, file, "intermediate_size")
        q, kv = heads * head_dim, kv_heads * head_dim
        attention = hidden * q + 2 * hidden * kv + q * hidden
        if model_type == "qwen2":  # biases on q, k and v
            attention += q + 2 * kv
        elif config.get("attention_bias"):
            attention += q + 2 * kv + hidden
        mlp = 3 * hidden * inner + (2 * inner + hidden if config.get("mlp_bias") else 0)
        per_layer = attention + mlp + 2 * hidden  # two RMS norms
        tied = config.get("tie_word_embeddings", False)  # these families' own default
        return vocab * hidden + layers * per_layer + hidden + (0 if tied else vocab * hidden)
    if model_type == "gpt2":
        positions = _field(config, file, "n_positions", "max_position_embeddings")
        inner = config.get("n_inner") or 4 * hidden
        per_layer = 2 * (2 * hidden) + (hidden * 3 * hidden + 3 * hidden) + (hidden * hidden + hidden) + (hidden * inner + inner) + (inner * hidden + hidden)
        return vocab * hidden + positions * hidden + layers * per_layer + 2 * hidden  # the head is tied to the embedding
    raise HFConfigError(
        f"{file}: counting a {model_type!r} model needs transformers (pip install 'netoptim-train[integrations]'); "
        f"without it, the families counted from the config's fields are {sorted(_LLAMA_LIKE | {'gpt2'})}"
    )


def _count_on_meta(file: Path) -> int:
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        raise HFConfigError(f"{file}: counting with transformers needs it installed: pip install 'netoptim-train[integrations]'") from exc
    try:
        config = AutoConfig.from_pretrained(str(file.parent))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # transformers says what it could not build; the file is what the user gave
        raise HFConfigError(f"{file}: transformers cannot build a causal LM from it: {exc}") from exc
    return sum(p.numel() for p in model.parameters())  # a tied weight is one parameter: counted once
