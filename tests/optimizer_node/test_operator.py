"""The operator's part of a node on its own: what it owns (the pause, the overrides) and what it is
given (where the job stands, a way to tell the workers, a way to release the updates held, the node's
own status), with stand-ins for those and the job's real parts (store, ledger, checkpoints, morph
gate, update path choice). The node wired to it is tested through the admin service (test_admin.py,
test_overrides.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from optimizer_node.admin.operator import NodeOperator
from optimizer_node.admin.overrides import OperatorOverrides
from optimizer_node.config import NodeConfig
from optimizer_node.faults import CrashPoints
from optimizer_node.intake.morphing import MorphGate
from optimizer_node.intake.step_ledger import StepLedger
from optimizer_node.state.persistence import Checkpoints
from optimizer_node.state.storage import InMemoryStore
from optimizer_node.update.adamw import HyperOverrides
from optimizer_node.update.path_choice import UpdatePathChoice


class StandInJob:
    """Where the job stands, as the operator reads it: a job of two ranks at step 3, between steps;
    and what the operator is given besides: the workers told, the updates held, the job's end."""

    def __init__(self) -> None:
        self.ledger = StepLedger()
        self.store = InMemoryStore()
        self.job = SimpleNamespace(
            spec=SimpleNamespace(world_size=2, max_grad_norm=None, num_nodes=1, moments="fp32", moment_block=256), owned={}, state_bytes=0
        )
        self.step = 3
        self.job_end = SimpleNamespace(finished_step=None)
        self.notices: list[tuple[dict, list[bytes] | None, int]] = []
        self.held = 5  # updates waiting for the pause to end

    def between_steps(self) -> bool:
        return True

    def tell_workers(self, meta: dict, *, peers=None, rank: int = -1) -> None:
        self.notices.append((meta, None if peers is None else list(peers), rank))

    def release_held(self) -> int:
        released, self.held = self.held, 0
        return released


@pytest.fixture
def operated() -> tuple[NodeOperator, StandInJob]:
    job = StandInJob()
    overrides = OperatorOverrides()
    checkpoints = Checkpoints(NodeConfig(), CrashPoints(None), job, overrides, "node-a")  # type: ignore[arg-type]
    operator = NodeOperator(
        job,  # type: ignore[arg-type]
        overrides,
        checkpoints=checkpoints,
        job_end=job.job_end,  # type: ignore[arg-type]
        morphs=MorphGate(),
        update_paths=UpdatePathChoice(enabled=False),
        tell_workers=job.tell_workers,
        release_held=job.release_held,
        node_status=lambda: {"node_id": "node-a", "data_address": "tcp://127.0.0.1:1", "uptime_s": 1.0, "jobs_let_go": 0},
    )
    return operator, job


def test_a_pause_holds_updates_until_resumed_and_every_worker_is_told(operated):
    operator, job = operated
    assert operator.job_state() == "training" and operator.resume() == 0, "nothing to resume"
    assert operator.pause("") == 3
    assert operator.pause_reason == "paused by the operator" and operator.job_state() == "paused"
    assert job.notices[-1] == ({"paused": True, "reason": "paused by the operator"}, None, -1)
    assert job.held == 5, "paused: nothing released"
    assert operator.resume() == 5 and job.held == 0
    assert operator.pause_reason is None and operator.job_state() == "training"
    assert job.notices[-1] == ({"paused": False, "reason": ""}, None, -1)
    assert operator.status()["paused"] is None and operator.status()["step"] == 3


def test_resume_undoes_a_drain_and_the_job_state_follows_the_job(operated):
    operator, job = operated
    operator._checkpoints.drain_step = 3
    assert operator.job_state() == "drained" and operator.status()["drain_step"] == 3
    job.step = 2
    assert operator.job_state() == "draining"
    operator.resume()
    assert operator._checkpoints.drain_step is None and operator.job_state() == "training"
    job.job_end.finished_step = 2
    assert operator.job_state() == "finished"
    job.job = None
    assert operator.job_state() == "idle" and operator.status()["world_size"] == 0


def test_leave_requests_go_to_present_ranks_only_and_bad_ranks_are_refused(operated):
    operator, job = operated
    job.ledger.register(0, b"peer0", 11)
    job.ledger.register(1, b"peer1", 12)
    job.ledger.mark_left(1)
    assert operator.ask_to_leave([1, 0, 0], "spot preemption") == [0], "rank 1 left already"
    assert job.notices == [({"leave": "spot preemption"}, [b"peer0"], 0)]
    for bad in ([2], [-1], []):
        with pytest.raises(ValueError, match="not ranks of the job"):
            operator.ask_to_leave(bad, "")
    assert operator.workers().keys() == {0, 1}
    job.job = None
    with pytest.raises(ValueError, match="no job is registered"):
        operator.ask_to_leave([0], "")


def test_overrides_are_the_operators_and_invalid_ones_change_nothing(operated):
    operator, _job = operated
    operator.set_overrides(HyperOverrides(lr_scale=0.5))
    assert operator.hyper_overrides.lr_scale == 0.5 and [entry["name"] for entry in operator.override_list()] == ["lr_scale"]
    with pytest.raises(ValueError):
        operator.set_overrides(HyperOverrides(lr_scale=-1.0))
    assert operator.hyper_overrides.lr_scale == 0.5
    operator.set_max_grad_norm(1.0)
    assert operator.max_grad_norm == 1.0 and operator.clip_override == 1.0
