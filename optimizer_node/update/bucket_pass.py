"""The node's update of one bucket in one pass: sum the workers' gradients in rank order and apply
AdamW while the sum is in cache, then cast the outgoing copy.

Two ways, with the same result bit for bit:

* the compiled loop of :mod:`optimizer_node.update.kernels.compiled_update` (numba), when it is installed and has
  passed its check against torch's kernel on this machine: one loop reads every gradient, the
  parameters and both moments once and writes the last three (and the bf16 copy) once: 32 bytes per
  parameter with two fp32 workers, the sum's reads overlapping the update's;
* torch ops, chunk by chunk (``CHUNK_NUMEL`` elements): the chunk's sum, then torch's fused AdamW
  kernel on it, then the chunk's cast. This is the fallback, and the path for what the loop does not
  take (fp16 gradients, gradients in several frames, the clipping path's multiplier) and for the
  first updates of a process, while the loop is checked in the background.

Bitwise equality with ``torch.optim.AdamW(fused=True)`` fed the averaged gradient holds because each
element's gradient is added in rank order, ``((g0 + g1) + g2) ...`` in fp32, and divided by the number
of workers as the kernel does, with the same step for every chunk (incremented once per bucket); and
because the kernel's math is elementwise except that the last ``numel % vector_width`` elements of a
tensor take a scalar path that can round differently. Chunks and blocks cut a parameter's segment
only at multiples of ``SPLIT_ALIGNMENT`` elements from its start, and the compiled loop leaves each
segment's last ``numel % SPLIT_ALIGNMENT`` elements to torch's kernel, so every element takes the
path it takes when the whole segment is one tensor.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch

from optimizer_node.update.adamw import AdamWHyper, fused_adamw
from optimizer_node.update.kernels import compiled_update
from optimizer_node.update.pass_plan import CHUNK_NUMEL, plan_chunks, plan_loop
from optimizer_node.update.reduce import OrderedReduction, TensorPieces
from optimizer_node.update.rules import apply_rule


class _Term:
    """One term of the sum (a rank's gradient, or the partial sum) as received, in pieces."""

    def __init__(self, pieces: TensorPieces) -> None:
        self.pieces = sorted(pieces, key=lambda piece: piece[0])
        self.offsets = [offset for offset, _ in self.pieces]

    def views(self, start: int, stop: int) -> list[tuple[int, torch.Tensor]]:
        """``(offset from start, view)`` pieces covering elements ``start .. stop - 1``."""
        found = []
        for offset, view in self.pieces[max(0, bisect.bisect_right(self.offsets, start) - 1) :]:
            if offset >= stop:
                break
            low, high = max(start, offset), min(stop, offset + view.numel())
            if low < high:
                found.append((low - start, view[low - offset : high - offset]))
        return found


class _Scratch(threading.local):
    """A reused fp32 buffer per thread for a chunk's sum (a fresh one per chunk would be page faults)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0)

    def get(self, numel: int) -> torch.Tensor:
        if numel > self.buffer.numel():
            self.buffer = torch.empty(numel)
        return self.buffer[:numel]


_scratch = _Scratch()


def add_in_rank_order(terms: Sequence[_Term], start: int, stop: int, out: torch.Tensor) -> None:
    """``out`` = the sum of the terms' elements ``start .. stop - 1``, added in order, in fp32."""
    views = [term.views(start, stop) for term in terms]
    first = 0
    if len(views) >= 2 and len(views[0]) == len(views[1]) == 1 and views[0][0][1].dtype == views[1][0][1].dtype == torch.float32:
        torch.add(views[0][0][1], views[1][0][1], out=out)  # the same fp32 addition as copy then add, one op fewer
        first = 2
    elif views and not views[0]:  # the first rank sent no gradient (none of the bucket's parameters had one): zeros
        out.zero_()
        first = 1
    for index, pieces in enumerate(views[first:], first):
        for offset, view in pieces:
            target = out[offset : offset + view.numel()]
            if index == 0:
                target.copy_(view)  # exact upcast
            elif view.dtype == torch.float32:
                target.add_(view)
            else:  # upcast first (exact): torch's mixed-dtype in-place add is slower
                target.add_(view.to(torch.float32))


def reduce_and_update(
    reduction: OrderedReduction,
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamWHyper,
    *,
    segments: Sequence[tuple[int, int]] | None = None,
    grad_divisor: torch.Tensor | None = None,
    grad_multiplier: torch.Tensor | None = None,
    wire_out: torch.Tensor | None = None,
    previous_out: torch.Tensor | None = None,
    chunk_numel: int = CHUNK_NUMEL,
    compiled: bool = True,
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
    param_out: torch.Tensor | None = None,
) -> bool:
    """Finish ``reduction`` (complete) and apply one AdamW step to the bucket, in one pass; True where
    the compiled loop did it, False where torch ops did.

    Bitwise equal to ``adamw_update(param, reduction.result, ...)`` with the same arguments, then
    ``wire_out.copy_(param)``. ``grad_multiplier`` (the clip coefficient) multiplies the gradient
    before the kernel, as the daemon's clipping path does to the (already averaged) sum;
    ``grad_divisor`` divides it inside the kernel. ``wire_out``, when given, receives the new
    parameters cast to its dtype; ``previous_out`` the parameters as they were, cast to its dtype (in
    fp32, read in the same pass, while the update has them in cache). ``compiled=False`` keeps to torch ops. ``arrays``:
    numpy views of ``param``, ``exp_avg``, ``exp_avg_sq`` and ``step`` the caller keeps (made here
    otherwise). ``param_out`` (fp32, no ``wire_out``): the new parameters go there and ``param`` is
    only read (a node's master values moving to its parameter board's other slot; the compiled loop
    writes each value once, torch ops copy ``param`` there first). The reduction lets go of the
    received frames; they are freed when this returns.
    """
    segments = tuple(segments) if segments is not None else ((0, param.numel()),)
    chunks = plan_chunks(segments, chunk_numel)  # also checks that the segments tile the bucket
    if not chunks or chunks[-1].stop != param.numel():
        raise ValueError(f"segments cover {chunks[-1].stop if chunks else 0} elements, the bucket has {param.numel()}")
    for name, out in (("wire_out", wire_out), ("previous_out", previous_out), ("param_out", param_out)):
        if out is not None and out.numel() != param.numel():
            raise ValueError(f"{name} has {out.numel()} elements, the bucket {param.numel()}")
    if param_out is not None and (wire_out is not None or param_out.dtype != torch.float32):
        raise ValueError("param_out takes the new fp32 parameters and is the outgoing copy: give no wire_out")
    if previous_out is not None and previous_out.dtype != torch.float32:
        previous_out.copy_(param)  # a cast of its own (the node's wire copy usually serves instead)
        previous_out = None
    pending = reduction.take_pending()
    step_count = step.numpy() if arrays is None else arrays[3]
    step_count[()] += 1  # once per bucket: every kernel call reads the same step (fp32 + 1, as step.add_(1), at a tenth of its cost)
    loop = compiled and grad_multiplier is None and grad_divisor is not None
    out = wire_out if param_out is None else param_out
    if loop and _compiled_pass(pending, param, exp_avg, exp_avg_sq, step, hyper, segments, grad_divisor, out, previous_out, arrays, keep=param_out is not None):
        return True
    if param_out is not None:  # torch ops update in place: the values go there first
        param, previous_out = move_for_update_in_place(param, param_out, previous_out)
    terms = [_Term(pieces) for pieces in pending]
    for chunk in chunks:
        if previous_out is not None:
            previous_out[chunk.start : chunk.stop].copy_(param[chunk.start : chunk.stop])
        _update_pieces(terms, chunk.start, chunk.stop, chunk.pieces, param, exp_avg, exp_avg_sq, step, hyper, grad_divisor, grad_multiplier)
        if wire_out is not None:  # while the chunk's parameters are in cache
            wire_out[chunk.start : chunk.stop].copy_(param[chunk.start : chunk.stop])
    return False


def move_for_update_in_place(param: torch.Tensor, param_out: torch.Tensor, previous_out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """For a pass that updates in place but must leave ``param`` as it is: ``previous_out`` filled
    from it now, ``param`` copied into ``param_out`` (unless they are one); returns what to update
    (``param_out``) and what is left of ``previous_out`` to fill (nothing)."""
    if previous_out is not None:
        previous_out.copy_(param)
    if param_out.data_ptr() != param.data_ptr():
        param_out.copy_(param)
    return param_out, None


def reduce_and_update_segments(
    reduction: OrderedReduction,
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    steps: Sequence[torch.Tensor],
    hyper: AdamWHyper,
    *,
    segments: Sequence[tuple[int, int]],
    stepped: Sequence[bool],
    rule: str = "adamw",
    grad_divisor: torch.Tensor | None = None,
    grad_multiplier: torch.Tensor | None = None,
    wire_out: torch.Tensor | None = None,
    previous_out: torch.Tensor | None = None,
) -> None:
    """Like :func:`reduce_and_update`, for a bucket whose segments keep step counts of their own.

    ``steps[i]`` is segment ``i``'s AdamW step count (0-d fp32), incremented here when ``stepped[i]``;
    a segment not stepped (its parameter had no gradient on any rank) is left exactly as it is:
    parameters, moments and step count, as ``torch.optim.AdamW`` leaves a parameter whose ``grad`` is
    None. Each stepped segment is one tensor of torch's kernel, as in the reference. ``rule``: any
    of :data:`protos.job.hyper.RULES` (see :mod:`optimizer_node.update.rules`)."""
    if not (len(steps) == len(stepped) == len(segments)):
        raise ValueError(f"{len(segments)} segments, {len(steps)} step counts and {len(stepped)} flags")
    for name, out in (("wire_out", wire_out), ("previous_out", previous_out)):
        if out is not None and out.numel() != param.numel():
            raise ValueError(f"{name} has {out.numel()} elements, the bucket {param.numel()}")
    if previous_out is not None:
        previous_out.copy_(param)
    terms = [_Term(pieces) for pieces in reduction.take_pending()]
    for (offset, numel), step, stepping in zip(segments, steps, stepped, strict=True):
        if not stepping:
            continue
        grad = _scratch.get(numel)
        add_in_rank_order(terms, offset, offset + numel, grad)
        if grad_multiplier is not None:
            grad.mul_(grad_multiplier)
        step.add_(1)
        window = slice(offset, offset + numel)
        apply_rule(rule, param[window], grad, exp_avg[window], exp_avg_sq[window], step, hyper, grad_divisor)
    if wire_out is not None:
        wire_out.copy_(param)


def _compiled_pass(
    pending: Sequence[TensorPieces],
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamWHyper,
    segments: tuple[tuple[int, int], ...],
    grad_divisor: torch.Tensor,
    wire_out: torch.Tensor | None,
    previous_out: torch.Tensor | None,
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
    *,
    keep: bool = False,
) -> bool:
    """The update (and bf16 copy) through the compiled loop, the segments' tails through torch ops;
    False, having done nothing, if the loop does not take these terms or is not ready. ``keep``: the
    new values go to ``wire_out`` (fp32) alone, ``param`` is only read.

    A gradient that came in several frames (the wire cuts a message into ``chunk_bytes`` pieces: a
    16 MiB bucket is four) is taken window by window, a window being a stretch where every term is
    one frame: the loop is elementwise, so where its blocks are cut changes no bit."""
    numel = param.numel()
    whole = True  # every term one frame: the whole bucket in one call, nothing cut (a bucket's hot path)
    for pieces in pending:
        if len(pieces) != 1:
            whole = False
            break
    windows = [(0, numel, [pieces[0][1] for pieces in pending])] if whole else _frame_windows(pending, numel)
    heads = [_head_of(views) for _lo, _hi, views in windows]
    for head, (_lo, _hi, views) in zip(heads, windows, strict=True):
        if not compiled_update.supports(head, views[1:] if head is not None else views):
            return False
    if not compiled_update.ready():
        return False
    threads = compiled_update.loop_threads()  # once a bucket: the plan's rounds and the kernel's threads
    plan = plan_loop(segments, threads=threads)
    # the loop writes the outgoing copy: bf16 bits, or fp32 (a parameter board's slot) from fp32 frames
    loop_copy = None
    if wire_out is not None and (wire_out.dtype is torch.bfloat16 or (wire_out.dtype is torch.float32 and windows[0][2][-1].dtype is torch.float32)):
        loop_copy = wire_out
    if keep and loop_copy is None:  # 16-bit frames into fp32 masters elsewhere: torch ops
        return False
    step_value = float(arrays[3]) if arrays is not None else float(step)  # a numpy scalar reads faster than a tensor
    divisor = float(grad_divisor)
    if whole:
        head, views = heads[0], windows[0][2]
        compiled_update.update(
            param, exp_avg, exp_avg_sq, head, views[1:] if head is not None else views, loop_copy, plan.blocks, hyper, step_value, divisor, previous_out,
            arrays=arrays and arrays[:3], threads=threads, keep=keep,
        )  # fmt: skip
    for head, (lo, hi, views) in zip(heads, windows, strict=True) if not whole else ():
        blocks = _blocks_within(plan.blocks, lo, hi)
        if not len(blocks):
            continue
        compiled_update.update(
            param[lo:hi],
            exp_avg[lo:hi],
            exp_avg_sq[lo:hi],
            head,
            views[1:] if head is not None else views,
            _cut(loop_copy, lo, hi),
            blocks,
            hyper,
            step_value,
            divisor,
            _cut(previous_out, lo, hi),
            arrays=arrays and tuple(array[lo:hi] for array in arrays[:3]),
            threads=threads,
            keep=keep,
        )
    if plan.tails:
        start, stop = plan.tails[0][0], plan.tails[-1][0] + plan.tails[-1][1]
        if previous_out is not None:
            for offset, numel in plan.tails:
                previous_out[offset : offset + numel].copy_(param[offset : offset + numel])
        target = param
        if keep and loop_copy is not None:  # torch's kernel updates in place: there, from the values read
            for offset, numel in plan.tails:
                loop_copy[offset : offset + numel].copy_(param[offset : offset + numel])
            target = loop_copy
        _update_pieces([_Term(pieces) for pieces in pending], start, stop, plan.tails, target, exp_avg, exp_avg_sq, step, hyper, grad_divisor, None)
        if loop_copy is not None and not keep:
            for offset, numel in plan.tails:
                loop_copy[offset : offset + numel].copy_(param[offset : offset + numel])
    if wire_out is not None and loop_copy is None:
        wire_out.copy_(param)
    return True


_T = TypeVar("_T", torch.Tensor, np.ndarray)


def _cut(values: _T | None, lo: int, hi: int) -> _T | None:
    """``values[lo:hi]``, or ``None``."""
    return None if values is None else values[lo:hi]


def _head_of(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The fp32 partial sum that leads lower-precision frames, if the terms start with one."""
    return views[0] if len(views) > 1 and views[0].dtype == torch.float32 and views[1].dtype != torch.float32 else None


def _frame_windows(pending: Sequence[TensorPieces], numel: int) -> list[tuple[int, int, list[torch.Tensor]]]:
    """``(start, stop, views)``: ``0 .. numel`` cut wherever any term's frame ends, with each term's
    view of that stretch (one frame each)."""
    if all(len(pieces) == 1 for pieces in pending):
        return [(0, numel, [pieces[0][1] for pieces in pending])]
    cuts = sorted({offset for pieces in pending for offset, _view in pieces} | {numel})
    windows = []
    at = [0] * len(pending)  # each term's piece holding the window's start
    for lo, hi in itertools.pairwise(cuts):
        views = []
        for index, pieces in enumerate(pending):
            while pieces[at[index]][0] + pieces[at[index]][1].numel() <= lo:
                at[index] += 1
            offset, view = pieces[at[index]]
            views.append(view[lo - offset : hi - offset])
        windows.append((lo, hi, views))
    return windows


def _blocks_within(blocks: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The parts of ``blocks`` inside ``lo .. hi``, counted from ``lo``."""
    starts, stops = np.maximum(blocks[:, 0], lo), np.minimum(blocks[:, 1], hi)
    keep = starts < stops
    return np.stack([starts[keep] - lo, stops[keep] - lo], axis=1)


def _update_pieces(
    terms: Sequence[_Term],
    start: int,
    stop: int,
    pieces: Sequence[tuple[int, int]],
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamWHyper,
    grad_divisor: torch.Tensor | None,
    grad_multiplier: torch.Tensor | None,
) -> None:
    """Sum and update ``pieces`` (inside ``start .. stop - 1``) with torch ops: each piece one tensor of
    torch's kernel. Contiguous pieces are summed by one set of ops; scattered ones piece by piece."""
    contiguous = sum(numel for _, numel in pieces) == stop - start
    grad = _scratch.get(stop - start if contiguous else sum(numel for _, numel in pieces))
    grads: list[torch.Tensor] = []
    if contiguous:
        add_in_rank_order(terms, start, stop, grad)
        grads = [grad[offset - start : offset - start + numel] for offset, numel in pieces]
    else:
        at = 0
        for offset, numel in pieces:
            grads.append(grad[at : at + numel])
            add_in_rank_order(terms, offset, offset + numel, grads[-1])
            at += numel
    if grad_multiplier is not None:
        grad.mul_(grad_multiplier)
    fused_adamw(
        [param[offset : offset + numel] for offset, numel in pieces],
        grads,
        [exp_avg[offset : offset + numel] for offset, numel in pieces],
        [exp_avg_sq[offset : offset + numel] for offset, numel in pieces],
        step,
        hyper,
        grad_divisor=grad_divisor,
    )
