"""Merging the checkpoints of a job's nodes into one ordinary state dict with the model's own
parameter names, written as ``.pt`` (``torch.save``) or ``.safetensors``; or read parameter by
parameter (:func:`iter_parameters`), so that a writer never holds the whole model."""

from __future__ import annotations

import json
import logging
import re
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from optimizer_node.state.checkpoint import Checkpoint, CheckpointError
from protos.job.spec import JobSpec

log = logging.getLogger(__name__)

_PLACEHOLDER_NAME = re.compile(r"^group\d+\.param\d+$")
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def job_checkpoints(checkpoints: Sequence[Checkpoint]) -> tuple[JobSpec, dict[int, Checkpoint], int]:
    """The job of one checkpoint per node, its checkpoints by node index, and their step.

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
    if any(_PLACEHOLDER_NAME.match(param.name) for param in spec.params):
        log.warning(
            "the job was registered without parameter names (give RemoteAdamW model.named_parameters()): "
            "the export names each groupG.paramP, the P-th parameter of param group G"
        )
    return spec, by_node, int(first["step"])


def iter_parameters(checkpoints: Sequence[Checkpoint]) -> Iterator[tuple[str, torch.Tensor]]:
    """The job's fp32 parameters, one at a time in the job's order, each as ``(name, tensor)`` of its
    shape; at most two buckets' values are read in at once (a parameter may span buckets), so a
    writer of shards holds one shard, not the model. :class:`CheckpointError` as :func:`job_checkpoints`."""
    spec, by_node, _ = job_checkpoints(checkpoints)
    pieces: list[list[tuple[int, int, int, int]]] = [[] for _ in spec.params]  # param -> (bucket, bucket offset, param offset, numel)
    node_of: dict[int, int] = {}
    for bucket in spec.plan():
        node_of[bucket.bucket_id] = bucket.node
        for seg in bucket.segments:
            pieces[seg.param_index].append((bucket.bucket_id, seg.bucket_offset, seg.param_offset, seg.numel))
    loaded: dict[int, torch.Tensor] = {}
    for param, param_pieces in zip(spec.params, pieces, strict=True):
        values = torch.empty(param.numel, dtype=torch.float32)
        for bucket_id, bucket_offset, param_offset, numel in param_pieces:
            if bucket_id not in loaded:
                if len(loaded) >= 2:
                    loaded.pop(next(iter(loaded)))  # the oldest: the job's order walks the buckets forward
                loaded[bucket_id] = by_node[node_of[bucket_id]].buckets[bucket_id].param
            values[param_offset : param_offset + numel] = loaded[bucket_id][bucket_offset : bucket_offset + numel]
        yield param.name, values.view(param.shape)


def merge_checkpoints(checkpoints: Sequence[Checkpoint]) -> tuple[dict[str, torch.Tensor], int]:
    """The fp32 parameters of a whole job from one checkpoint per node; returns (state dict, step).

    Raises :class:`CheckpointError` as :func:`job_checkpoints`.
    """
    spec, by_node, step = job_checkpoints(checkpoints)
    flat = [torch.empty(param.numel, dtype=torch.float32) for param in spec.params]
    for bucket in spec.plan():
        values = by_node[bucket.node].buckets[bucket.bucket_id].param
        for seg in bucket.segments:
            flat[seg.param_index][seg.param_offset : seg.param_offset + seg.numel] = values[seg.bucket_offset : seg.bucket_offset + seg.numel]
    state = {param.name: tensor.view(param.shape) for param, tensor in zip(spec.params, flat, strict=True)}
    return state, step


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
