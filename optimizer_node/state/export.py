"""Merging the checkpoints of a job's nodes into one ordinary state dict with the model's own
parameter names, written as ``.pt`` (``torch.save``) or ``.safetensors``."""

from __future__ import annotations

import json
import logging
import re
import struct
from collections.abc import Sequence
from pathlib import Path

import torch

from netoptim.job.spec import JobSpec
from optimizer_node.state.checkpoint import Checkpoint, CheckpointError

log = logging.getLogger(__name__)

_PLACEHOLDER_NAME = re.compile(r"^group\d+\.param\d+$")
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def merge_checkpoints(checkpoints: Sequence[Checkpoint]) -> tuple[dict[str, torch.Tensor], int]:
    """The fp32 parameters of a whole job from one checkpoint per node; returns (state dict, step).

    Raises :class:`CheckpointError` when the checkpoints are of different jobs or steps, or when a
    node is missing or given twice.
    """
    if not checkpoints:
        raise CheckpointError("no checkpoint given")
    first = checkpoints[0].manifest
    spec = JobSpec.from_wire(first["job"])
    by_node: dict[int, Checkpoint] = {}
    for checkpoint in checkpoints:
        manifest = checkpoint.manifest
        if manifest["job"] != first["job"]:
            raise CheckpointError(f"{checkpoint.path} is of another job than {checkpoints[0].path}")
        if manifest["step"] != first["step"]:
            raise CheckpointError(
                f"{checkpoint.path} is at step {manifest['step']}, {checkpoints[0].path} at step {first['step']}: export checkpoints of the same step"
            )
        node_index = int(manifest["node_index"])
        if node_index in by_node:
            raise CheckpointError(f"{checkpoint.path} and {by_node[node_index].path} are both node {node_index}")
        by_node[node_index] = checkpoint
    missing = sorted(set(range(spec.num_nodes)) - set(by_node))
    if missing:
        raise CheckpointError(f"the job has {spec.num_nodes} nodes; checkpoints of node(s) {missing} are missing")
    flat = [torch.empty(param.numel, dtype=torch.float32) for param in spec.params]
    for bucket in spec.plan():
        values = by_node[bucket.node].buckets[bucket.bucket_id].param
        for seg in bucket.segments:
            flat[seg.param_index][seg.param_offset : seg.param_offset + seg.numel] = values[seg.bucket_offset : seg.bucket_offset + seg.numel]
    if any(_PLACEHOLDER_NAME.match(param.name) for param in spec.params):
        log.warning("the job was registered without parameter names (give RemoteAdamW model.named_parameters()); the export uses placeholder names")
    state = {param.name: tensor.view(param.shape) for param, tensor in zip(spec.params, flat, strict=True)}
    return state, int(first["step"])


def save_safetensors(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``state`` in the safetensors format: a little-endian u64 header length, a JSON header
    (dtype, shape, byte range per tensor), then the raw bytes."""
    header: dict[str, object] = {"__metadata__": metadata or {}}
    offset = 0
    tensors = []
    for name, tensor in state.items():
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"{name}: dtype {tensor.dtype} is not exported")
        data = tensor.detach().contiguous().cpu()
        nbytes = data.numel() * data.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[data.dtype], "shape": list(data.shape), "data_offsets": [offset, offset + nbytes]}
        tensors.append(data)
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for data in tensors:
            handle.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()) if data.numel() else b"")


def export(checkpoints: Sequence[Checkpoint], destination: Path) -> tuple[int, int]:
    """Merge and write; returns (step, number of parameters)."""
    state, step = merge_checkpoints(checkpoints)
    if destination.suffix == ".safetensors":
        save_safetensors(state, destination, {"format": "pt", "netoptim_step": str(step)})
    elif destination.suffix in (".pt", ".pth"):
        torch.save(state, destination)
    else:
        raise ValueError(f"{destination}: the file name must end in .safetensors or .pt")
    return step, sum(t.numel() for t in state.values())
