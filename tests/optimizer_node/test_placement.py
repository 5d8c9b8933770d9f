from __future__ import annotations

import random

import pytest

from protos.job.placement import SPLIT_ALIGNMENT, ParamSpec, first_difference, plan_buckets


def specs(*sizes: int, groups: list[int] | None = None) -> list[ParamSpec]:
    groups = groups or [0] * len(sizes)
    return [ParamSpec(f"p{i}", (n,), "float32", g) for i, (n, g) in enumerate(zip(sizes, groups, strict=True))]


def covered(params, buckets):
    seen = {i: [] for i in range(len(params))}
    for bucket in buckets:
        position = 0
        for seg in bucket.segments:
            assert seg.bucket_offset == position
            position += seg.numel
            seen[seg.param_index].append((seg.param_offset, seg.numel))
        assert position == bucket.numel
    return seen


@pytest.mark.parametrize("seed", range(20))
def test_every_element_in_exactly_one_bucket(seed):
    rng = random.Random(seed)
    params = specs(*[rng.randint(1, 5000) for _ in range(rng.randint(1, 30))], groups=None)
    bucket_numel = rng.choice([64, 100, 1000, 4096])
    buckets = plan_buckets(params, bucket_numel, rng.randint(1, 4))
    for index, pieces in covered(params, buckets).items():
        offset = 0
        for piece_offset, numel in pieces:
            assert piece_offset == offset
            offset += numel
            if offset < params[index].numel:  # every piece but the last is whole vectors
                assert numel % SPLIT_ALIGNMENT == 0
        assert offset == params[index].numel
    assert all(b.numel <= bucket_numel for b in buckets)


def test_groups_never_share_a_bucket():
    buckets = plan_buckets(specs(10, 10, 10, groups=[0, 0, 1]), 1000, 1)
    assert [(b.group, b.numel) for b in buckets] == [(0, 20), (1, 10)]


def test_balanced_and_deterministic():
    params = specs(*([1000] * 12))
    buckets = plan_buckets(params, 1000, 3)
    assert [b.node for b in buckets] == [0, 1, 2] * 4
    assert buckets == plan_buckets(params, 1000, 3)


def test_bad_input():
    with pytest.raises(ValueError, match="duplicate parameter name"):
        plan_buckets([ParamSpec("a", (1,), "float32", 0)] * 2, 64, 1)
    with pytest.raises(ValueError, match="unit starts"):
        plan_buckets(specs(1, 1), 64, 1, unit_starts=[2])
    with pytest.raises(ValueError, match="at least 64"):
        plan_buckets(specs(1), 10, 1)
    with pytest.raises(ValueError, match="num_nodes"):
        plan_buckets(specs(1), 64, 0)


def test_first_difference_names_the_parameter():
    a = specs(4, 5)
    assert first_difference(a, a) is None
    b = [a[0], ParamSpec("p1", (6,), "float32", 0)]
    assert "parameter 1 differs" in first_difference(a, b) and "[5]" in first_difference(a, b)
    assert "first extra in this worker: 2 'x'" in first_difference(a, [*a, ParamSpec("x", (1,), "float32", 0)])


def test_buckets_end_at_group_changes_and_unit_starts():
    interleaved = plan_buckets(specs(1, 1, 1, groups=[0, 1, 0]), 64, 1)
    assert [(b.group, [s.param_index for s in b.segments]) for b in interleaved] == [(0, [0]), (1, [1]), (0, [2])]
    units = plan_buckets(specs(10, 10, 10, 10), 1000, 2, unit_starts=[0, 2])
    assert [[s.param_index for s in b.segments] for b in units] == [[0, 1], [2, 3]]
    assert [b.node for b in units] == [0, 1]
