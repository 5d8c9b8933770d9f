"""LandedPushes on its own, with stand-ins for the pushes: buckets go out in order once their copies
landed, and a push that fails stays queued with its gradients for the step's retry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gpu_worker.layerwise.landed_pushes import LandedPushes


class StandInSession:
    """Stages every bucket; a bucket's copy lands when the test says; the first push of ``fail_once`` raises."""

    def __init__(self, fail_once: int | None = None) -> None:
        self.buckets = [SimpleNamespace(segments=[SimpleNamespace(param_index=i)]) for i in range(3)]
        self.landed: set[int] = set()
        self.pushed: list[tuple[int, torch.Tensor | None]] = []
        self._fail_once = fail_once

    def stage_bucket(self, bucket_id, grads) -> bool:
        return True

    def staged_landed(self, bucket_id) -> bool:
        return bucket_id in self.landed

    def push_bucket(self, bucket_id, grads, hypers) -> None:
        if bucket_id == self._fail_once:
            self._fail_once = None
            raise ConnectionError("the node went away")
        self.pushed.append((bucket_id, grads[bucket_id]))


def test_buckets_go_in_order_once_landed_and_a_failed_push_stays_for_the_retry():
    session = StandInSession(fail_once=1)
    pushes = LandedPushes(session.buckets, stage=session.stage_bucket, push=session.push_bucket, landed=session.staged_landed)  # type: ignore[arg-type]
    grads = [torch.full((2,), float(i)) for i in range(3)]
    for bucket_id in range(3):
        pushes.push(bucket_id, grads, hypers=())
    session.landed |= {1, 2}
    pushes.send_landed()
    assert session.pushed == [] and len(pushes) == 3, "bucket 0 has not landed: nothing after it goes"
    session.landed.add(0)
    with pytest.raises(ConnectionError):
        pushes.send_landed()
    assert [b for b, _ in session.pushed] == [0] and len(pushes) == 2, "the failed push is still queued"
    grads[1] = None  # the unit's grad attributes are cleared after its hook: the queued push kept its own
    pushes.send_all()
    assert [b for b, _ in session.pushed] == [0, 1, 2] and len(pushes) == 0
    assert torch.equal(session.pushed[1][1], torch.full((2,), 1.0))
