"""The node's math alone: AdamW, clipping and the ordered reduction, against torch."""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

from optimizer_node.update.adamw import AdamWHyper, adamw_update, clip_coefficient, sum_of_squares
from optimizer_node.update.bucket_pass import reduce_and_update
from optimizer_node.update.kernels import compiled_update
from optimizer_node.update.pass_plan import plan_chunks, plan_loop
from optimizer_node.update.reduce import OrderedReduction


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_adamw_update_is_bitwise_torch_fused(world_size):
    generator = torch.Generator().manual_seed(world_size)
    initial = torch.randn(1003, generator=generator)
    reference = torch.nn.Parameter(initial.clone())
    optimizer = torch.optim.AdamW([reference], lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05, fused=True)
    param, exp_avg, exp_avg_sq, step = initial.clone(), torch.zeros(1003), torch.zeros(1003), torch.zeros(())
    hyper = AdamWHyper(3e-3, 0.8, 0.99, 1e-7, 0.05)
    for _ in range(10):
        summed = torch.randn(1003, generator=generator) * world_size
        reference.grad = summed / world_size
        optimizer.step()
        adamw_update(param, summed.clone(), exp_avg, exp_avg_sq, step, hyper, grad_divisor=torch.tensor(float(world_size)))
    assert torch.equal(param, reference.detach())
    assert torch.equal(exp_avg, optimizer.state[reference]["exp_avg"])


def test_clip_coefficient_matches_clip_grad_norm():
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=generator) for n in (10, 300, 77)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, 1.5)
    total, coefficient = clip_coefficient(sum(sum_of_squares(g) for g in grads), 1.5)
    assert total == pytest.approx(float(norm), rel=1e-6)
    assert torch.allclose(grads[0] * coefficient, params[0].grad, rtol=1e-6, atol=0)
    _, no_clip = clip_coefficient(0.25, 1.5)
    assert float(no_clip) == 1.0


def test_hyperparameter_validation():
    for bad, word in [
        ((-1e-3, 0.9, 0.999, 1e-8, 0.0), "learning rate"),
        ((1e-3, 1.0, 0.999, 1e-8, 0.0), "beta1"),
        ((1e-3, 0.9, -0.1, 1e-8, 0.0), "beta2"),
        ((1e-3, 0.9, 0.999, -1.0, 0.0), "eps"),
        ((1e-3, 0.9, 0.999, 1e-8, float("nan")), "weight_decay"),
    ]:
        with pytest.raises(ValueError, match=word):
            AdamWHyper(*bad).validate()
    with pytest.raises(ValueError, match="lr, beta1"):
        AdamWHyper.from_wire([1.0, "x", 0.9, 1.0, 0.0])


def test_reduction_sums_in_rank_order_whatever_the_arrival_order():
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(500, generator=generator) * 10 ** (i % 3) for i in range(5)]
    expected = grads[0].clone()
    for grad in grads[1:]:
        expected += grad
    for order in ([4, 2, 0, 3, 1], [0, 1, 2, 3, 4], [3, 4, 1, 2, 0]):
        reduction = OrderedReduction(500, 5, lambda: torch.empty(500))
        for rank in order:
            assert not reduction.complete
            reduction.add(rank, [(0, grads[rank][:200]), (200, grads[rank][200:])])
        assert reduction.complete and reduction.missing() == []
        assert torch.equal(reduction.result, expected)
    whole = [g.clone() for g in grads]
    reduction = OrderedReduction(500, 5, lambda: torch.empty(500))
    for rank in (2, 0, 1, 4, 3):
        reduction.add(rank, [(0, whole[rank])])
    assert reduction.result.data_ptr() == whole[0].data_ptr()  # rank 0's frame became the accumulator
    assert torch.equal(reduction.result, expected)


def test_reduction_upcasts_bf16():
    reduction = OrderedReduction(4, 2, lambda: torch.empty(4))
    reduction.add(1, [(0, torch.full((4,), 1.5, dtype=torch.bfloat16))])
    assert reduction.missing() == [0]
    reduction.add(0, [(0, torch.full((4,), 0.25, dtype=torch.bfloat16))])
    assert reduction.result.dtype == torch.float32 and torch.equal(reduction.result, torch.full((4,), 1.75))


# ---------------------------------------------------------------- the one-pass update (sum in rank order + AdamW)

SEGMENT_SIZES = (1003, 64 * 3 + 5, 20_000 + 17, 77, 1, 15_001)  # odd sizes; none a multiple of the chunk
WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _segments(sizes):
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return list(zip(offsets, sizes, strict=True))


def _as_frames(flat, generator):
    """``flat`` as the wire delivers it: pieces at arbitrary element offsets (several frames)."""
    cuts = sorted(torch.randint(1, flat.numel(), (2,), generator=generator).tolist())
    bounds = [0, *cuts, flat.numel()]
    return [(start, flat[start:stop].clone()) for start, stop in itertools.pairwise(bounds) if stop > start]


@pytest.fixture
def loop_calls(monkeypatch):
    """Counts the compiled loop's calls (the bucket went through it, not through torch ops)."""
    compiled_update.usable()  # its check, run once, calls the loop too
    calls = []
    real = compiled_update.update

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(compiled_update, "update", counted)
    return calls


@pytest.mark.parametrize("wire", list(WIRE_DTYPES))
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("path", ["compiled", "compiled-1-thread", "compiled-frames-in-pieces", "torch", "torch-frames-in-pieces"])
def test_reduce_and_update_is_bitwise_torch_fused(world_size, wire, path, loop_calls):
    """Several segments of odd sizes, chunks that cut segments, any arrival order, several steps:
    bitwise torch.optim.AdamW(fused=True) fed the averaged gradient, the wire copy and the kept previous values; through the
    compiled loop (fp32 and bf16 frames, whole or in pieces cut anywhere) and through torch ops (everything, and what the
    loop does not take)."""
    compiled = path.startswith("compiled")
    if compiled and importlib.util.find_spec("numba") is None:
        pytest.skip("numba is not installed")
    assert not compiled or compiled_update.usable(), "the compiled loop differs from torch's kernel here: see its log"
    dtype = WIRE_DTYPES[wire]
    generator = torch.Generator().manual_seed(world_size)
    segments = _segments(SEGMENT_SIZES)
    numel = sum(SEGMENT_SIZES)
    initial = torch.randn(numel, generator=generator)
    reference = [torch.nn.Parameter(initial[offset : offset + size].clone()) for offset, size in segments]
    optimizer = torch.optim.AdamW(reference, lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05, fused=True)
    param, exp_avg, exp_avg_sq, step = initial.clone(), torch.zeros(numel), torch.zeros(numel), torch.zeros(())
    wire_out = torch.empty(numel, dtype=dtype)
    hyper = AdamWHyper(3e-3, 0.8, 0.99, 1e-7, 0.05)
    divisor = torch.tensor(float(world_size))
    threads = torch.get_num_threads()
    if path == "compiled-1-thread":
        torch.set_num_threads(1)
    try:
        for step_index in range(4):
            grads = [(torch.randn(numel, generator=generator) * 10 ** (rank % 3)).to(dtype) for rank in range(world_size)]
            summed = grads[0].float()
            for grad in grads[1:]:
                summed = summed + grad.float()
            averaged = summed / world_size
            for p, (offset, size) in zip(reference, segments, strict=True):
                p.grad = averaged[offset : offset + size].clone()
            optimizer.step()

            reduction = OrderedReduction(numel, world_size, lambda: torch.empty(numel), defer=True)
            # in order (a partial sum of the first ranks, then the last frame), last rank first (every frame held), random
            orders = [list(range(world_size)), list(reversed(range(world_size)))]
            for rank in orders[step_index] if step_index < 2 else torch.randperm(world_size, generator=generator).tolist():
                in_pieces = path.endswith("frames-in-pieces") and (rank + step_index) % 2 == 0
                reduction.add(rank, _as_frames(grads[rank], generator) if in_pieces else [(0, grads[rank].clone())])
            assert reduction.complete
            before, previous = param.clone(), torch.full((numel,), float("nan"))
            reduce_and_update(
                reduction, param, exp_avg, exp_avg_sq, step, hyper,
                segments=segments, grad_divisor=divisor, wire_out=wire_out, previous_out=previous, chunk_numel=4096, compiled=compiled,
            )  # fmt: skip
            assert torch.equal(previous, before), "the kept values are the parameters before the update"
            expected = torch.cat([p.detach() for p in reference])
            assert torch.equal(param, expected), f"step {step_index}"
            assert torch.equal(exp_avg, torch.cat([optimizer.state[p]["exp_avg"] for p in reference]))
            assert torch.equal(exp_avg_sq, torch.cat([optimizer.state[p]["exp_avg_sq"] for p in reference]))
            assert torch.equal(wire_out, expected.to(dtype))
    finally:
        torch.set_num_threads(threads)
    assert float(step) == 4.0
    if path == "compiled-frames-in-pieces" and wire != "float16":  # a call per stretch where every term is one frame
        assert len(loop_calls) > 4
    else:
        assert len(loop_calls) == (4 if compiled and wire != "float16" else 0)  # fp16 frames: torch ops


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("path", ["compiled", "compiled-1-thread", "compiled-frames-in-pieces", "torch"])
def test_new_values_written_beside_the_ones_read_are_bitwise_torch_fused(world_size, path, loop_calls):
    """An fp32 node's masters on its board: each update reads one slot and writes the other
    (``param_out``), the slot read left as it was (the version before, for a restarted rank); bitwise
    torch's fused AdamW, tails through torch's kernel included; the last step writes over the slot it
    reads (a board without room for a second slot)."""
    compiled = path.startswith("compiled")
    generator = torch.Generator().manual_seed(10 + world_size)
    segments = _segments(SEGMENT_SIZES)
    numel = sum(SEGMENT_SIZES)
    initial = torch.randn(numel, generator=generator)
    reference = [torch.nn.Parameter(initial[offset : offset + size].clone()) for offset, size in segments]
    optimizer = torch.optim.AdamW(reference, lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05, fused=True)
    slots = [initial.clone(), torch.full((numel,), float("nan"))]
    exp_avg, exp_avg_sq, step = torch.zeros(numel), torch.zeros(numel), torch.zeros(())
    hyper = AdamWHyper(3e-3, 0.8, 0.99, 1e-7, 0.05)
    threads = torch.get_num_threads()
    if path == "compiled-1-thread":
        torch.set_num_threads(1)
    try:
        for step_index in range(5):
            grads = [torch.randn(numel, generator=generator) * 10 ** (rank % 3) for rank in range(world_size)]
            summed = grads[0].clone()
            for grad in grads[1:]:
                summed = summed + grad
            for p, (offset, size) in zip(reference, segments, strict=True):
                p.grad = (summed / world_size)[offset : offset + size].clone()
            optimizer.step()
            reduction = OrderedReduction(numel, world_size, lambda: torch.empty(numel), defer=True)
            for rank in range(world_size):
                in_pieces = path.endswith("frames-in-pieces") and rank % 2 == 0
                reduction.add(rank, _as_frames(grads[rank], generator) if in_pieces else [(0, grads[rank].clone())])
            source = slots[step_index % 2]
            target = source if step_index == 4 else slots[(step_index + 1) % 2]
            before, previous = source.clone(), torch.full((numel,), float("nan")) if step_index % 2 else None
            reduce_and_update(
                reduction, source, exp_avg, exp_avg_sq, step, hyper, segments=segments, grad_divisor=torch.tensor(float(world_size)),
                previous_out=previous, chunk_numel=4096, compiled=compiled, param_out=target,
            )  # fmt: skip
            expected = torch.cat([p.detach() for p in reference])
            assert torch.equal(target, expected), f"step {step_index}"
            if target is not source:
                assert torch.equal(source, before), "the slot read keeps the version before"
            if previous is not None:
                assert torch.equal(previous, before)
            assert torch.equal(exp_avg, torch.cat([optimizer.state[p]["exp_avg"] for p in reference]))
            assert torch.equal(exp_avg_sq, torch.cat([optimizer.state[p]["exp_avg_sq"] for p in reference]))
    finally:
        torch.set_num_threads(threads)
    if compiled:
        assert len(loop_calls) >= 5
    else:
        assert not loop_calls
    with pytest.raises(ValueError, match="give no wire_out"):
        reduce_and_update(OrderedReduction(numel, 1, lambda: torch.empty(numel)), slots[0], exp_avg, exp_avg_sq, step, hyper,
                          grad_divisor=torch.tensor(1.0), wire_out=torch.empty(numel), param_out=slots[1])  # fmt: skip


def test_compiled_loop_agrees_with_this_torch():
    """The loop's own check against torch's kernel passes here: if a torch release changes its kernel's
    arithmetic, this fails (the node would quietly fall back to torch ops)."""
    if importlib.util.find_spec("numba") is None:
        pytest.skip("numba is not installed")
    assert compiled_update.run_self_check() is None
    assert compiled_update.usable()


def test_compiled_loop_can_be_turned_off(monkeypatch, loop_calls):
    monkeypatch.setenv("NETOPTIM_COMPILED_UPDATE", "0")
    compiled_update.forget_check()
    try:
        assert not compiled_update.usable()
        numel = 300
        reduction = OrderedReduction(numel, 2, lambda: torch.empty(numel), defer=True)
        reduction.add(0, [(0, torch.ones(numel))])
        reduction.add(1, [(0, torch.ones(numel))])
        param, exp_avg, exp_avg_sq, step = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel), torch.zeros(())
        reduce_and_update(reduction, param, exp_avg, exp_avg_sq, step, AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.0), grad_divisor=torch.tensor(2.0))
        assert loop_calls == [] and torch.equal(exp_avg, torch.full((numel,), 0.1))
    finally:
        monkeypatch.delenv("NETOPTIM_COMPILED_UPDATE")
        compiled_update.forget_check()


@pytest.mark.parametrize("chunk_numel", [64, 4096, 1 << 17])
def test_reduce_and_update_equals_sum_then_update(chunk_numel):
    """The pass against the two-pass path it replaces (reduction.result, then adamw_update), with the
    clipping path's multiplier too; bitwise, at chunk sizes from the smallest to larger than the bucket."""
    generator = torch.Generator().manual_seed(chunk_numel)
    segments = _segments(SEGMENT_SIZES)
    numel = sum(SEGMENT_SIZES)
    hyper = AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.01)
    grads = [torch.randn(numel, generator=generator) for _ in range(3)]
    start = [torch.randn(numel, generator=generator), torch.randn(numel, generator=generator), torch.rand(numel, generator=generator)]
    for multiplier in (None, torch.tensor(0.37)):
        two_pass = [t.clone() for t in start] + [torch.zeros(())]
        one_pass = [t.clone() for t in start] + [torch.zeros(())]
        for _ in range(2):
            eager = OrderedReduction(numel, 3, lambda: torch.empty(numel))
            deferred = OrderedReduction(numel, 3, lambda: torch.empty(numel), defer=True)
            for rank in (1, 0, 2):
                eager.add(rank, [(0, grads[rank].clone())])
                deferred.add(rank, [(0, grads[rank].clone())])
            grad = eager.result
            divisor = torch.tensor(3.0)
            if multiplier is not None:  # as the daemon clips: divide for the norm, multiply, no divisor in the kernel
                grad.div_(3).mul_(multiplier)
                deferred.result.div_(3)
                divisor = None
            adamw_update(two_pass[0], grad, two_pass[1], two_pass[2], two_pass[3], hyper, segments=segments, grad_divisor=divisor)
            reduce_and_update(
                deferred, one_pass[0], one_pass[1], one_pass[2], one_pass[3], hyper,
                segments=segments, grad_divisor=divisor, grad_multiplier=multiplier, chunk_numel=chunk_numel,
            )  # fmt: skip
        for a, b in zip(two_pass, one_pass, strict=True):
            assert torch.equal(a, b)


def test_deferred_reduction_holds_the_last_arrivals_and_sums_the_rest():
    calls = []

    def buffer():
        calls.append(1)
        return torch.empty(8)

    grads = [torch.full((8,), float(2**rank), dtype=torch.bfloat16) for rank in range(3)]
    reduction = OrderedReduction(8, 3, buffer, defer=True)
    reduction.add(0, [(0, grads[0])])
    assert calls == []  # rank 0 alone stays a bf16 frame rather than an fp32 copy
    reduction.add(1, [(0, grads[1])])
    assert calls == [1] and torch.equal(reduction.result, torch.full((8,), 3.0))  # ranks 0 and 1 in order
    reduction.add(2, [(0, grads[2])])
    assert reduction.complete and reduction.missing() == []
    terms = reduction.take_pending()  # the partial sum, then rank 2's frame, left to the update pass
    assert len(terms) == 2 and terms[1][0][1] is grads[2]
    fp32 = [torch.full((8,), float(rank + 1)) for rank in range(2)]
    reduction = OrderedReduction(8, 2, buffer, defer=True)
    reduction.add(1, [(0, fp32[1])])
    reduction.add(0, [(0, fp32[0])])
    assert torch.equal(reduction.result, torch.full((8,), 3.0))  # the whole sum on demand (clipping needs it)
    assert reduction.result.data_ptr() == fp32[0].data_ptr()


def test_chunks_cut_segments_only_at_the_split_alignment():
    from protos.job.placement import SPLIT_ALIGNMENT

    segments = _segments(SEGMENT_SIZES)
    for chunk_numel in (64, 100, 4096, 1 << 20):
        chunks = plan_chunks(tuple(segments), chunk_numel)
        assert chunks[0].start == 0 and chunks[-1].stop == sum(SEGMENT_SIZES)
        covered = [piece for chunk in chunks for piece in chunk.pieces]
        assert sum(numel for _, numel in covered) == sum(SEGMENT_SIZES)
        for chunk, following in itertools.pairwise(chunks):
            assert chunk.stop == following.start and chunk.stop - chunk.start <= chunk_numel
        for offset, size in segments:
            parts = [(o, n) for o, n in covered if offset <= o < offset + size]
            assert sum(n for _, n in parts) == size
            assert all((o - offset) % SPLIT_ALIGNMENT == 0 for o, _ in parts)
    with pytest.raises(ValueError, match="tile"):
        plan_chunks(((0, 10), (11, 5)), 64)
    loop = plan_loop(tuple(segments), 4096)  # the compiled loop: whole multiples of the alignment, tails to torch
    covered = [(int(start), int(stop - start)) for start, stop in loop.blocks] + list(loop.tails)
    assert sum(numel for _, numel in covered) == sum(SEGMENT_SIZES)
    for offset, size in segments:
        parts = sorted((o, n) for o, n in covered if offset <= o < offset + size)
        assert all((o - offset) % SPLIT_ALIGNMENT == 0 for o, _ in parts) and sum(n for _, n in parts) == size
        assert all(n <= 4096 for _, n in parts)
        if size % SPLIT_ALIGNMENT:
            assert (offset + size - size % SPLIT_ALIGNMENT, size % SPLIT_ALIGNMENT) in loop.tails
    for threads in (3, 14):  # over threads: the same elements, in a whole number of rounds where one segment fills the bucket
        balanced = plan_loop(tuple(segments), 4096, threads)
        assert balanced.tails == loop.tails
        for offset, size in segments:
            parts = sorted((int(start), int(stop)) for start, stop in balanced.blocks if offset <= start < offset + size)
            assert all((start - offset) % SPLIT_ALIGNMENT == 0 and stop - start <= 2 * 4096 for start, stop in parts)
            assert all(stop == following for (_, stop), (following, _) in itertools.pairwise(parts))
            assert sum(stop - start for start, stop in parts) == size - size % SPLIT_ALIGNMENT
        one = plan_loop(((0, 1 << 20),), 16384, threads)
        sizes = one.blocks[:, 1] - one.blocks[:, 0]
        assert len(one.blocks) % threads == 0 and int(sizes.max() - sizes.min()) <= SPLIT_ALIGNMENT and int(sizes.sum()) == 1 << 20


def test_the_streaming_copy_is_exact_at_every_alignment_and_length():
    """The board's copy: a scalar head up to a 32-byte boundary of the target, non-temporal vector
    stores, a scalar tail; every element lands, nothing past the end is touched."""
    if importlib.util.find_spec("numba") is None:
        pytest.skip("numba is not installed")
    from optimizer_node.update.kernels._numba_kernels import stream_copy

    source = torch.randn(300).numpy()
    for shift in range(9):  # target starts 0..8 floats past a 32-byte boundary
        for length in (0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 200):
            target = torch.full((320,), -1.0).numpy()
            stream_copy(source[:length], target[shift : shift + length])
            assert (target[shift : shift + length] == source[:length]).all(), (shift, length)
            assert (target[:shift] == -1).all() and (target[shift + length :] == -1).all(), (shift, length)


def test_a_bucket_with_segments_not_stepped_writes_beside_too():
    """The per-segment pass (a segment without a gradient on any rank keeps its values and step
    count) and a push with no gradient at all, with the new values going to another slot: the same
    bits as in place, the slot read unchanged."""
    from optimizer_node.state.storage import BucketState
    from optimizer_node.update.bucket_update import update_bucket

    generator = torch.Generator().manual_seed(3)
    segments = _segments(SEGMENT_SIZES)
    numel = sum(SEGMENT_SIZES)
    initial = torch.randn(numel, generator=generator)
    hyper = AdamWHyper(1e-2, 0.9, 0.99, 1e-8, 0.01)

    def bucket() -> BucketState:
        return BucketState(0, initial.clone(), torch.zeros(numel), torch.zeros(numel), torch.zeros(()))

    in_place, beside = bucket(), bucket()
    for absent in (frozenset({1, 4}), frozenset(range(len(segments))), frozenset({0})):
        grad = torch.randn(numel, generator=generator)
        for state, out in ((in_place, None), (beside, torch.full((numel,), float("nan")))):
            reduction = OrderedReduction(numel, 1, lambda: torch.empty(numel))
            reduction.add(0, [(0, grad.clone())])
            read = state.param.clone()
            arguments = dict(
                segments=segments, absent_everywhere=absent, grad_divisor=torch.tensor(1.0), grad_multiplier=None, wire_out=None, previous_out=None
            )
            update_bucket(state, reduction, hyper, compiled=False, param_out=out, **arguments)
            if out is not None:
                assert torch.equal(state.param, read), "the slot read keeps its values"
                state.param = out  # as the node does: the slot written holds the masters now
        assert torch.equal(in_place.param, beside.param) and torch.equal(in_place.exp_avg, beside.exp_avg)
        assert in_place.segment_steps == beside.segment_steps
