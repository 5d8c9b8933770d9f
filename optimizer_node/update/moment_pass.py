"""The update of a bucket whose moments are compressed (:mod:`optimizer_node.moments`).

What it computes is defined segment by segment with torch ops (:func:`torch_update_segments`):
decode the segment's moments to fp32, apply the rule exactly as for fp32 moments (torch's fused
kernels; :mod:`optimizer_node.update.rules`), encode the new moments. The fp32 master parameters are
updated with the fresh fp32 moments, so they are what they would be with fp32 moments given the same
moments before the step; only the stored moments are rounded. AdamW on a bucket with one step count
takes the compiled loop (:mod:`optimizer_node.update.kernels.moment_update`) for its compressed
segments once it has been checked bitwise against this definition, torch ops for the rest.

The gradient is summed in rank order in fp32 first, as for fp32 moments (two fp32 frames are summed
inside the loop, with the same single addition).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from optimizer_node.moments.codec import MomentCodec
from optimizer_node.state.storage import BucketState
from optimizer_node.update.bucket_pass import _scratch, _Term, add_in_rank_order, move_for_update_in_place
from optimizer_node.update.kernels import moment_update
from optimizer_node.update.reduce import OrderedReduction
from optimizer_node.update.rules import apply_rule
from protos.job.hyper import AdamWHyper

TWO_MOMENT_RULES = ("adamw", "adam")
"""Rules that keep a second moment; the others' ``exp_avg_sq`` is never read or written."""


def torch_update_segments(
    codec: MomentCodec,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    steps: Sequence[torch.Tensor],
    stepped: Sequence[bool],
    rule: str,
    hyper: AdamWHyper,
    grad_divisor: torch.Tensor | None,
) -> None:
    """One step of ``rule`` on each stepped segment of the bucket, in place: ``param`` fp32,
    ``grad`` the summed fp32 gradient (may be overwritten), ``exp_avg``/``exp_avg_sq`` encoded,
    ``steps[i]`` segment ``i``'s step count, already incremented."""
    second = rule in TWO_MOMENT_RULES
    for index, layout in enumerate(codec.layouts):
        if not stepped[index]:
            continue
        window = slice(layout.offset, layout.offset + layout.numel)
        m = codec.decode_segment(index, exp_avg, True)
        v = codec.decode_segment(index, exp_avg_sq, False) if second else torch.zeros(0)
        apply_rule(rule, param[window], grad[window], m, v, steps[index], hyper, grad_divisor)
        codec.encode_segment(index, m, exp_avg, True)
        if second:
            codec.encode_segment(index, v, exp_avg_sq, False)


def self_check() -> str | None:
    """The compiled loop against :func:`torch_update_segments` on random buckets (8 bits and bf16,
    plain and compressed segments, both branches of torch's lerp, three steps): the first
    difference, or ``None``."""
    generator = torch.Generator().manual_seed(20261207)
    segments = ((0, 8192), (8192, 100), (8292, 4096 * 3), (20580, 64 * 70))
    numel = 20580 + 64 * 70
    for format in ("8bit", "bf16"):
        codec = MomentCodec(format, 256, segments)
        compressed = [layout.compressed for layout in codec.layouts]
        plain = [not flag for flag in compressed]
        for beta1 in (0.9, 0.4):
            hyper = AdamWHyper(1e-3, beta1, 0.999, 1e-8, 0.01)
            param = torch.randn(numel, generator=generator)
            mine = [param.clone(), codec.zeros(), codec.zeros()]
            reference = [param.clone(), codec.zeros(), codec.zeros()]
            for step in range(1, 4):
                grads = (torch.randn(numel, generator=generator), torch.randn(numel, generator=generator) * 1e-3)
                divisor = torch.tensor(2.0)
                steps = [torch.tensor(float(step))] * len(segments)
                p, m, v = mine
                moment_update.update(codec, p, grads, m, v, hyper, float(step), 2.0)
                torch_update_segments(codec, p, grads[0] + grads[1], m, v, steps, plain, "adamw", hyper, divisor)
                p, m, v = reference
                torch_update_segments(codec, p, grads[0] + grads[1], m, v, steps, [True] * len(segments), "adamw", hyper, divisor)
                for name, got, want in zip(("param", "exp_avg", "exp_avg_sq"), mine, reference, strict=True):
                    if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                        return f"{format} moments, beta1 {beta1}, step {step}: {name} differs"
    return None


def update_compressed(
    state: BucketState,
    reduction: OrderedReduction,
    hyper: AdamWHyper,
    *,
    stepped: Sequence[bool],
    rule: str,
    grad_divisor: torch.Tensor | None,
    grad_multiplier: torch.Tensor | None,
    wire_out: torch.Tensor | None,
    previous_out: torch.Tensor | None,
    param_out: torch.Tensor | None,
) -> bool:
    """Apply the step to a bucket with compressed moments (``state.codec``), as
    :func:`~optimizer_node.update.bucket_update.update_bucket` describes its arguments; True where
    the compiled loop did the compressed segments. The node's choice between its two fp32 paths
    does not apply: compressed moments have one fast path, in memory and out of core (their torch-ops
    path is the definition, many times slower), taken wherever it is checked and takes the update."""
    codec = state.codec
    assert codec is not None
    numel = state.numel
    param = state.param
    if param_out is not None:  # the new values go there, from the values read
        param, previous_out = move_for_update_in_place(param, param_out, previous_out)
    elif previous_out is not None:
        previous_out.copy_(param)
    pending = reduction.take_pending()
    frames = [pieces[0][1] for pieces in pending if len(pieces) == 1 and pieces[0][0] == 0 and pieces[0][1].numel() == numel]
    whole_fp32 = len(frames) == len(pending) and all(frame.dtype is torch.float32 for frame in frames)
    one_count = state.segment_steps is None and all(stepped)
    loop = rule == "adamw" and one_count and grad_multiplier is None and grad_divisor is not None and moment_update.ready(self_check)
    if loop and whole_fp32 and len(frames) <= 2:
        grads: tuple[torch.Tensor, ...] = tuple(frames)
    else:
        grad = _scratch.get(numel)
        add_in_rank_order([_Term(pieces) for pieces in pending], 0, numel, grad)
        if grad_multiplier is not None:
            grad.mul_(grad_multiplier)
        grads = (grad,)
    if one_count:
        state.step_tensor.add_(1)
        steps = [state.step_tensor] * len(codec.layouts)
    else:
        steps = [torch.tensor(count, dtype=torch.float32) for count in state.segment_step_counts(len(codec.layouts))]
        for step, stepping in zip(steps, stepped, strict=True):
            if stepping:
                step.add_(1)
    if loop:
        assert grad_divisor is not None
        moment_update.update(codec, param, grads, state.exp_avg, state.exp_avg_sq, hyper, float(state.step_tensor), float(grad_divisor))
        rest = [stepping and not layout.compressed for stepping, layout in zip(stepped, codec.layouts, strict=True)]
        grad = grads[0]
        if len(grads) == 2:  # the plain segments' sum: the same single addition as the loop's
            grad = _scratch.get(numel)
            for layout in codec.layouts:
                if not layout.compressed:
                    window = slice(layout.offset, layout.offset + layout.numel)
                    torch.add(grads[0][window], grads[1][window], out=grad[window])
        torch_update_segments(codec, param, grad, state.exp_avg, state.exp_avg_sq, steps, rest, rule, hyper, grad_divisor)
    else:
        torch_update_segments(codec, param, grads[0], state.exp_avg, state.exp_avg_sq, steps, stepped, rule, hyper, grad_divisor)
    if not one_count:
        state.set_segment_step_counts([float(step) for step in steps])
    if wire_out is not None and wire_out.data_ptr() != param.data_ptr():
        wire_out.copy_(param)
    return loop
