"""The worker's decisions on the nodes' accounts: where a rank resumes, what a node that came back lost."""

from __future__ import annotations

import pytest

from gpu_worker.links.norm_totals import NormTotals
from gpu_worker.links.resume import WorkerProgress, gradients_lost, resume_point
from transport.wire import Header, MsgType

OWNERS = [0, 0, 1, 1]  # bucket -> node


def test_resume_point_is_the_lowest_step_and_a_node_ahead_holds_all_of_its_buckets() -> None:
    point = resume_point({0: (3, [1]), 1: (4, [])}, OWNERS, rank=0)
    assert point.step == 3
    assert point.contributed == {1, 2, 3}


def test_resume_point_refuses_nodes_more_than_a_step_apart() -> None:
    with pytest.raises(RuntimeError, match="disagree on the step of rank 2"):
        resume_point({0: (3, []), 1: (5, [])}, OWNERS, rank=2)


def _progress(**changes) -> WorkerProgress:
    base = WorkerProgress(rank=1, layerwise=False, mine=[0, 1], bucket_steps=[5, 5, 5, 5], seen_step=5, advanced_at={}, pushed={}, keeps_gradients=True)
    return base._replace(**changes)


def test_a_node_back_at_the_workers_step_lost_what_it_does_not_list() -> None:
    step, lost = gradients_lost("n0", 5, {0}, False, _progress(pushed={0: 5, 1: 5}))
    assert (step, lost) == (5, [1])


def test_a_node_back_without_state_or_behind_the_worker_says_what_to_restart() -> None:
    with pytest.raises(RuntimeError, match="without the job's state"):
        gradients_lost("n0", 0, set(), True, _progress())
    with pytest.raises(RuntimeError, match="came back at step 3, but rank 1 is at step 5"):
        gradients_lost("n0", 3, set(), False, _progress())
    with pytest.raises(RuntimeError, match="is at step 7"):
        gradients_lost("n0", 7, set(), False, _progress())


def test_a_layerwise_worker_cannot_push_lost_gradients_again() -> None:
    ahead = _progress(layerwise=True, bucket_steps=[6, 6, 5, 5], seen_step=5, advanced_at={0: 5, 1: 5}, keeps_gradients=False)
    with pytest.raises(RuntimeError, match="lost this worker's gradients of 1 bucket"):
        gradients_lost("n0", 5, {0}, False, ahead)
    assert gradients_lost("n0", 5, {0, 1}, False, ahead) == (6, [])


def test_a_full_model_worker_that_let_its_gradients_go_is_told_to_restart() -> None:
    """RemoteAdamW(keep_step_gradients=False): the pushed gradients a restarted node lost cannot go
    again; the worker is told so, and what to do, instead of waiting for values that never come."""
    pushed = _progress(pushed={0: 5, 1: 5}, keeps_gradients=True)
    assert gradients_lost("n0", 5, {1}, False, pushed) == (5, [0])  # kept: pushed again
    let_go = _progress(pushed={0: 5, 1: 5}, keeps_gradients=False)
    with pytest.raises(RuntimeError, match=r"let go once pushed \(keep_step_gradients=False\): restart the worker \(it redoes step 5\)"):
        gradients_lost("n0", 5, {1}, False, let_go)
    assert gradients_lost("n0", 5, {0, 1}, False, let_go) == (5, [])  # the node holds both: nothing lost


def test_norm_totals_add_in_node_order_and_answer_a_repeat_with_the_same_total() -> None:
    sent: list[tuple[int, Header]] = []
    totals = NormTotals()

    def share(index: int, value: float) -> None:
        totals.on_share(index, Header(msg_type=MsgType.NORM_PARTIAL, step=4, meta={"sum_of_squares": value}), [0, 1], lambda i, h: sent.append((i, h)), 0)

    share(1, 2.0)
    assert not sent
    share(0, 1.0)
    assert [(i, h.msg_type, h.step, h.meta["sum_of_squares"]) for i, h in sent] == [(0, MsgType.CLIP, 4, 3.0), (1, MsgType.CLIP, 4, 3.0)]
    share(1, 9.0)  # a node that restarted asks again: the same total, to it alone
    assert [(i, h.meta["sum_of_squares"]) for i, h in sent[2:]] == [(1, 3.0)]
    totals.forget()
    share(0, 1.0)
    assert len(sent) == 3
