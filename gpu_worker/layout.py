"""A worker's view of its parameters as buckets: naming, flattening gradients into send buffers and
installing received values back into the parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch

from protos.job.placement import BucketSpec, ParamSpec
from transport.interface import Message
from transport.wire import dtype_name

TensorPieces = Sequence[tuple[int, torch.Tensor]]


def _param_dtype_name(param: torch.Tensor) -> str:
    try:
        return dtype_name(param.dtype)
    except TypeError:
        raise TypeError(f"parameters of dtype {param.dtype} cannot be offloaded; use float32, bfloat16 or float16") from None


def layout_from_groups(param_groups: Sequence[dict]) -> tuple[list[ParamSpec], list[torch.Tensor]]:
    """The job layout of an optimizer's param groups and the matching parameter tensors, in order.

    Names come from ``param_names`` (when the optimizer was given ``named_parameters()``), else they
    are ``group{g}.param{i}``. Parameters that do not require grad are in it too: as in torch's
    optimizers, they are not stepped while their gradient is None, and train once unfrozen.
    """
    specs: list[ParamSpec] = []
    tensors: list[torch.Tensor] = []
    for group_index, group in enumerate(param_groups):
        names: Iterable[str] = group.get("param_names") or (f"group{group_index}.param{i}" for i in range(len(group["params"])))
        for name, param in zip(names, group["params"], strict=True):
            if not param.is_contiguous():
                raise ValueError(f"parameter {name!r} is not contiguous; call .contiguous() on it before building the optimizer")
            specs.append(ParamSpec(name, tuple(param.shape), _param_dtype_name(param), group_index))
            tensors.append(param)
    return specs, tensors


class GradsOf:
    """``grads[i]``: the current gradient of layout parameter ``i``, read when a bucket asks for it (a
    hook per bucket must not build a list over every parameter)."""

    __slots__ = ("_params",)

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self._params = params

    def __getitem__(self, index: int) -> torch.Tensor | None:
        return self._params[index].grad


def step_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """The gradients ``step()`` pushes, one per layout parameter (None: none), checked: dense, each
    with its parameter's number of elements."""
    grads = [p.grad for p in params]
    for param, grad in zip(params, grads, strict=True):
        if grad is not None and grad.is_sparse:
            raise TypeError("RemoteAdamW does not support sparse gradients")
        if grad is not None and not math.prod(grad.shape) == param.numel():
            raise ValueError("a gradient's shape differs from its parameter's")
    return grads


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().view(-1)


def gather_bucket(bucket: BucketSpec, tensors: Sequence[torch.Tensor | None], out: torch.Tensor) -> None:
    """Copy (and cast) the bucket's pieces of ``tensors`` into the flat ``out``; ``None`` counts as zeros,
    as DDP does for a parameter that got no gradient."""
    gather_run((bucket,), tensors, out)


def gather_run(buckets: Sequence[BucketSpec], tensors: Sequence[torch.Tensor | None], out: torch.Tensor) -> None:
    """:func:`gather_bucket` for buckets laid back to back in ``out``, with one copy for each stretch
    that is contiguous both in a tensor and in ``out`` (consecutive buckets of one large parameter: a
    copy call per bucket cost more than small buckets' bytes)."""
    pieces: list[list[int]] = []  # [param_index, param_offset, out_offset, numel], merged
    base = 0
    for bucket in buckets:
        for seg in bucket.segments:
            at = base + seg.bucket_offset
            last = pieces[-1] if pieces else None
            if last is not None and last[0] == seg.param_index and last[1] + last[3] == seg.param_offset and last[2] + last[3] == at:
                last[3] += seg.numel
            else:
                pieces.append([seg.param_index, seg.param_offset, at, seg.numel])
        base += bucket.numel
    for param_index, param_offset, at, numel in pieces:
        target = out[at : at + numel]
        source = tensors[param_index]
        if source is None:
            target.zero_()
        else:
            target.copy_(_flat(source)[param_offset : param_offset + numel], non_blocking=True)


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    target.copy_(source)


def scatter_bucket(
    bucket: BucketSpec, pieces: TensorPieces, params: Sequence[torch.Tensor], copy: Callable[[torch.Tensor, torch.Tensor], None] = _copy
) -> None:
    """Install received bucket values (``(element_offset, view)`` chunks) into the parameters, in place
    (``copy(target, source)`` does each piece's copy)."""
    for chunk_offset, view in pieces:
        chunk_end = chunk_offset + view.numel()
        for seg in bucket.segments:
            low = max(seg.bucket_offset, chunk_offset)
            high = min(seg.bucket_offset + seg.numel, chunk_end)
            if low >= high:
                continue
            start = seg.param_offset + low - seg.bucket_offset
            copy(_flat(params[seg.param_index])[start : start + high - low], view[low - chunk_offset : high - chunk_offset])


class InstallTargets:
    """Where each bucket's received values go: views of the parameters, made once per bucket, so that
    installing a bucket that arrived whole is one ``copy_`` per segment. Making the views at each
    install cost ~5 us per bucket, most of a small bucket's install. A bucket's views are made again
    when one of its parameters' memory moved (``param.data`` replaced: another data pointer) or the
    layout changed; they keep the parameters' storage alive, which the worker holds anyway."""

    def __init__(self) -> None:
        self._cached: dict[int, tuple[BucketSpec, tuple[int, ...], tuple[torch.Tensor, ...]]] = {}

    def install(
        self, bucket: BucketSpec, pieces: TensorPieces, params: Sequence[torch.Tensor], copy: Callable[[torch.Tensor, torch.Tensor], None] = _copy
    ) -> None:
        """As :func:`scatter_bucket`."""
        if len(pieces) != 1 or pieces[0][0] != 0 or pieces[0][1].numel() != bucket.numel:
            scatter_bucket(bucket, pieces, params, copy)  # values in several chunks: cut as they fall
            return
        view = pieces[0][1]
        segments = bucket.segments
        entry = self._cached.get(bucket.bucket_id)
        if len(segments) == 1:  # the common case, kept short: one pointer to compare, one copy
            pointer = params[segments[0].param_index].data_ptr()
            if entry is None or entry[0] is not bucket or entry[1][0] != pointer:
                entry = self._made(bucket, params)
            copy(entry[2][0], view)
            return
        if entry is None or entry[0] is not bucket or entry[1] != tuple(params[seg.param_index].data_ptr() for seg in segments):
            entry = self._made(bucket, params)
        for seg, target in zip(segments, entry[2], strict=True):
            copy(target, view[seg.bucket_offset : seg.bucket_offset + seg.numel])

    def _made(self, bucket: BucketSpec, params: Sequence[torch.Tensor]) -> tuple[BucketSpec, tuple[int, ...], tuple[torch.Tensor, ...]]:
        segments = bucket.segments
        pointers = tuple(params[seg.param_index].data_ptr() for seg in segments)
        targets = tuple(_flat(params[seg.param_index])[seg.param_offset : seg.param_offset + seg.numel] for seg in segments)
        entry = self._cached[bucket.bucket_id] = (bucket, pointers, targets)
        return entry


def finish_board_read(message: Message, node: str) -> None:
    """After values read in place from a node's parameter board were copied out: ``RuntimeError`` if
    the node rewrote them meanwhile (the copy may be torn), else let go of the board's pages. The
    protocol rules a rewrite out (a bucket's next values exist only once every rank pushed the
    gradients of these), so it would be a node's bug, told rather than trained on."""
    if message.still_current is not None and not message.still_current():
        raise RuntimeError(
            f"node {node} replaced bucket {message.header.bucket_id}'s values of step {message.header.step} on its parameter board while this worker "
            "copied them: this worker's copy may be torn; restart the worker (it resumes at the nodes' step) and report this, it is a bug"
        )
    if message.release is not None:
        message.release()


def describe_bucket(params: Sequence[ParamSpec], bucket: BucketSpec) -> str:
    """The parameters a bucket holds, for messages (``parameters w[0:128], b``)."""
    parts = []
    for segment in bucket.segments:
        spec = params[segment.param_index]
        whole = segment.numel == spec.numel
        parts.append(spec.name if whole else f"{spec.name}[{segment.param_offset}:{segment.param_offset + segment.numel}]")
    return "parameters " + ", ".join(parts[:4]) + (f" and {len(parts) - 4} more" if len(parts) > 4 else "")
