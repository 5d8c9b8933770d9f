"""A worker's word that a bucket's gradient is finite (:mod:`gpu_worker.exchange.finite_probe`): given for a
finite sum only, never for NaN, inf, a sum that overflows or a gradient the wire casts. The probe's
torch calls are the same on CPU tensors; the CUDA path (the copy stream, page-locked sums, the word on
real pushes) is tested in ``test_cuda_path.py``."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.exchange.finite_probe import FiniteProbe
from protos.job.placement import BucketSpec, Segment


def bucket(bucket_id: int, *pieces: tuple[int, int, int]) -> BucketSpec:
    """A bucket of ``(param_index, param_offset, numel)`` pieces, laid back to back."""
    segments, at = [], 0
    for param_index, param_offset, numel in pieces:
        segments.append(Segment(param_index=param_index, param_offset=param_offset, bucket_offset=at, numel=numel))
        at += numel
    return BucketSpec(bucket_id=bucket_id, node=0, group=0, numel=at, segments=tuple(segments))


def test_the_word_is_given_for_finite_sums_only():
    probe = FiniteProbe(4, torch.float32)
    grads = [torch.randn(100), torch.randn(50)]
    one, two = bucket(0, (0, 0, 100)), bucket(1, (0, 60, 40), (1, 0, 50))
    assert probe.queue(one, grads) and probe.proven_finite(0)
    assert probe.queue(two, grads) and probe.proven_finite(1)
    for bad in (float("nan"), float("inf"), -float("inf")):
        dirty = [grads[0], grads[1].clone()]
        dirty[1][49] = bad
        assert probe.queue(two, dirty) and not probe.proven_finite(1)
        assert probe.queue(one, dirty) and probe.proven_finite(0)  # only bucket 1 holds parameter 1's tail
    outside = [grads[0].clone(), grads[1]]
    outside[0][10] = float("nan")  # in parameter 0, but not in bucket 1's piece of it
    assert probe.queue(two, outside) and probe.proven_finite(1)
    huge = [torch.full((100,), 3e38), grads[1]]  # every element finite, the sum not: no word, the node counts
    assert probe.queue(one, huge) and not probe.proven_finite(0)
    assert probe.vouched == 6
    assert probe.queue(two, [grads[0], None]) and probe.proven_finite(1)  # a parameter without a gradient is zeros on the wire
    assert not probe.queue(two, [None, None])  # nothing to sum: no word (such a push has no payload)


def test_no_word_where_the_wire_casts():
    probe = FiniteProbe(1, torch.float16)
    assert not probe.queue(bucket(0, (0, 0, 10)), [torch.full((10,), 70_000.0)])  # fp32 to fp16 would be inf
    assert probe.queue(bucket(0, (0, 0, 10)), [torch.ones(10, dtype=torch.float16)]) and probe.proven_finite(0)


def test_slots_follow_the_bucket_count():
    with pytest.raises(ValueError, match="at least 1"):
        FiniteProbe(0, torch.float32)
    probe = FiniteProbe(1, torch.float32)
    probe.resize(3)  # a param group added
    assert probe.queue(bucket(2, (0, 0, 5)), [torch.ones(5)]) and probe.proven_finite(2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_cpu_workers_word_is_the_sum_of_what_it_gathered_for_the_wire(dtype):
    probe = FiniteProbe(1, dtype)
    gathered = torch.randn(1000).to(dtype)
    assert probe.gathered_finite(gathered)
    for bad in (float("nan"), float("inf"), -float("inf")):
        dirty = gathered.clone()
        dirty[999] = bad
        assert not probe.gathered_finite(dirty)
    largest = torch.full((4,), torch.finfo(dtype).max, dtype=dtype)  # every element finite
    # fp32 and bf16 share fp32's range: their sum overflows, no word (the node counts); fp16's does not
    assert probe.gathered_finite(largest) == (dtype is torch.float16)
    assert probe.vouched == 1 + (dtype is torch.float16)
