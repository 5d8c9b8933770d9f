"""The node's math alone: AdamW, clipping and the ordered reduction, against torch."""

from __future__ import annotations

import pytest
import torch

from optimizer_node.adamw import AdamWHyper, adamw_update, clip_coefficient, sum_of_squares
from optimizer_node.reduce import OrderedReduction


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
