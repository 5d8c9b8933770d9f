"""Back to Hugging Face: the nodes' checkpoints of a job as a directory that
``AutoModelForCausalLM.from_pretrained`` loads (``netoptim export --hf DIR``).

The directory gets the model's ``config.json`` (from the model directory or config the job was
trained from, its dtype set to the one exported), the parameters as sharded safetensors files in
that dtype with ``model.safetensors.index.json`` (one ``model.safetensors`` when they fit one shard),
and the files beside the source config that describe the model rather than its weights (the
generation config, the tokenizer's files). The parameters are read from the checkpoints one at a
time (:func:`optimizer_node.state.export.iter_parameters`) and written shard by shard, so no process
holds the whole model. The parameter names are the ones the job registered: a model trained with
``RemoteAdamW(model.named_parameters(), ...)`` (or ``NetoptimTrainer``) has Hugging Face's own.

Where ``transformers`` is installed, the names are checked against the model the config describes
before anything is written: a parameter the model lacks, a shape that differs, or one the export
would leave out (a frozen parameter the nodes never held) stops the export with the names.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from optimizer_node.state.checkpoint import Checkpoint
from optimizer_node.state.export import iter_parameters, job_checkpoints, save_safetensors

log = logging.getLogger(__name__)

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Beside config.json in a model directory: what describes the model, not its weights.
_MODEL_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
INDEX_FILE = "model.safetensors.index.json"


class ExportError(ValueError):
    """The export cannot be made as asked; the message says what and what to do."""


def export_hf(
    checkpoints: Sequence[Checkpoint],
    destination: Path,
    *,
    config: Path,
    dtype: str = "bfloat16",
    max_shard_bytes: int = 5 * 10**9,
    check_with_transformers: bool | None = None,
) -> dict[str, int]:
    """Write the job of ``checkpoints`` (one per node, one step) as a Hugging Face model directory.

    Args:
        checkpoints: one checkpoint of each node of the job, of the same step.
        destination: the directory to write (created; refused if it holds files already).
        config: the model directory the job was trained from, or its ``config.json``.
        dtype: the parameters' dtype in the files: ``float32``, ``bfloat16`` or ``float16``.
        max_shard_bytes: the most bytes of parameters a shard holds (a larger parameter gets a shard
            of its own).
        check_with_transformers: check the names and shapes against the model the config describes:
            ``None`` where ``transformers`` is installed, ``True`` always, ``False`` never.

    Returns ``{"step", "params", "shards", "bytes"}``. Raises :class:`ExportError` for a destination,
    dtype or config that cannot serve, :class:`~optimizer_node.state.checkpoint.CheckpointError` for
    checkpoints that do not form a job.
    """
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"dtype {dtype!r}: export as one of {sorted(EXPORT_DTYPES)}")
    if max_shard_bytes <= 0:
        raise ExportError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    config_file = config / "config.json" if config.is_dir() else config
    try:
        model_config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{config_file}: cannot read the model's config ({exc}); give the model directory the job was trained from") from exc
    if not isinstance(model_config, dict) or "model_type" not in model_config:
        raise ExportError(f'{config_file}: not a Hugging Face model config (no "model_type")')
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise ExportError(f"{destination} exists and is not an empty directory: export into a new one")
    spec, _, step = job_checkpoints(checkpoints)
    torch_dtype = EXPORT_DTYPES[dtype]
    item = torch.empty((), dtype=torch_dtype).element_size()
    shapes = {param.name: tuple(param.shape) for param in spec.params}
    _check_names(shapes, config_file, check_with_transformers)
    # Shards by size first (the shapes are in the job's spec), so each file is named before it is written.
    shards: list[list[str]] = [[]]
    filled = 0
    for param in spec.params:
        nbytes = param.numel * item
        if shards[-1] and filled + nbytes > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(param.name)
        filled += nbytes
    names = ["model.safetensors"] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    destination.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    parameters = iter_parameters(checkpoints)
    total = 0
    for file_name, members in zip(names, shards, strict=True):
        shard: dict[str, torch.Tensor] = {}
        for expected in members:
            name, values = next(parameters)
            assert name == expected, "iter_parameters walks the job's params in order"
            shard[name] = values.to(torch_dtype)
            weight_map[name] = file_name
            total += values.numel() * item
        save_safetensors(shard, destination / file_name, {"format": "pt"})
        log.info("wrote %s (%d tensors)", file_name, len(shard))
    if len(names) > 1:
        index = {"metadata": {"total_size": total, "netoptim_step": step}, "weight_map": weight_map}
        (destination / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    model_config["torch_dtype"] = dtype
    model_config["dtype"] = dtype
    (destination / "config.json").write_text(json.dumps(model_config, indent=2) + "\n")
    for name in _MODEL_FILES:
        if (config_file.parent / name).is_file():
            shutil.copy2(config_file.parent / name, destination / name)
    return {"step": step, "params": sum(param.numel for param in spec.params), "shards": len(names), "bytes": total}


def _check_names(shapes: dict[str, tuple[int, ...]], config_file: Path, check: bool | None) -> None:
    """The job's parameters against the model the config describes (see the module docstring)."""
    if check is False:
        return
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        if check:
            raise ExportError("checking the names needs transformers: pip install 'netoptim-train[integrations]'") from None
        log.warning("transformers is not installed: the parameter names are not checked against %s", config_file)
        return
    try:
        config = AutoConfig.from_pretrained(str(config_file.parent))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # what transformers could not build; the file is what the user gave
        raise ExportError(f"{config_file}: transformers cannot build a causal LM from it: {exc}") from exc
    wanted = {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied weights once, as the job registered them
    unknown = sorted(set(shapes) - set(wanted))
    if unknown:
        raise ExportError(
            f"the job's parameters {unknown[:5]}{' ...' if len(unknown) > 5 else ''} are not the model's of {config_file} "
            "(train with RemoteAdamW(model.named_parameters(), ...) so the nodes hold Hugging Face's names, or give the config the job was trained from)"
        )
    wrong = sorted(name for name in shapes if shapes[name] != wanted[name])
    if wrong:
        raise ExportError(f"shapes differ from the model of {config_file}: " + ", ".join(f"{n} {shapes[n]} against {wanted[n]}" for n in wrong[:5]))
    left_out = sorted(set(wanted) - set(shapes))
    if left_out:
        raise ExportError(
            f"the nodes hold no values of {left_out[:5]}{' ...' if len(left_out) > 5 else ''} ({len(left_out)} parameter(s), frozen or not trained through "
            "netoptim): from_pretrained would initialize them at random; export those from the base model instead"
        )


__all__ = ["EXPORT_DTYPES", "ExportError", "export_hf"]
