"""What an operator can do to a running node (pause, resume, override hyperparameters, ask ranks to
leave, stop) and what it can see (status, workers): :class:`NodeOperator`, one per job, composed by
:class:`~optimizer_node.daemon.NodeDaemon`. It owns what the operator set (the pause, the
hyperparameter overrides) and reads the rest from the daemon's public face; it runs on the daemon
thread only: the admin service reaches it through the daemon's command queue.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from optimizer_node.admin.overrides import ADMIN, OperatorOverrides
from optimizer_node.job_state import JobNode
from optimizer_node.update.adamw import AdamWHyper, HyperOverrides

if TYPE_CHECKING:
    from collections.abc import Iterable

    from optimizer_node.control import StepClock
    from optimizer_node.intake.morphing import MorphGate
    from optimizer_node.intake.non_finite import NonFiniteStats
    from optimizer_node.state.persistence import Checkpoints
    from optimizer_node.state.storage import BucketStore
    from optimizer_node.update.path_choice import UpdatePathChoice

log = logging.getLogger(__name__)


class OperatedNode(JobNode, Protocol):
    """What :class:`NodeOperator` reads and asks of the daemon, besides :class:`JobNode`."""

    address: str
    started_at: float
    clock: StepClock
    non_finite: NonFiniteStats

    def between_steps(self) -> bool: ...
    def tell_workers(self, meta: dict, *, peers: Iterable[bytes] | None = None, rank: int = -1) -> None: ...
    def release_held_updates(self) -> int: ...


class NodeOperator:
    """Operator actions on one job's node, and the node's status.

    ``node``: the daemon, read through :class:`OperatedNode` (the updates held while paused are
    released through its ``release_held_updates``); ``overrides``: the job's, which checkpoints save
    too; ``store``, ``checkpoints``, ``morphs``, ``update_paths``: the job's parts, read for the status."""

    def __init__(
        self,
        node: OperatedNode,
        overrides: OperatorOverrides,
        *,
        store: BucketStore,
        checkpoints: Checkpoints,
        morphs: MorphGate,
        update_paths: UpdatePathChoice,
    ) -> None:
        self._node = node
        self.overrides = overrides  # hyperparameter overrides and the clipping threshold an operator set, with their origins
        self.pause_reason: str | None = None  # set while an operator has paused updates
        self._store = store
        self._checkpoints = checkpoints
        self._morphs = morphs
        self._update_paths = update_paths

    def pause(self, reason: str) -> int:
        """Stop applying updates (gradients still arrive and are summed); tells every worker why."""
        self.pause_reason = reason or "paused by the operator"
        log.warning("updates paused: %s", self.pause_reason)
        self._node.tell_workers({"paused": True, "reason": self.pause_reason})
        return self._node.step

    def resume(self) -> int:
        """Undo a pause (apply the updates held and go on) and a drain (take gradients of later steps
        again); returns how many buckets were updated now."""
        node = self._node
        if self._checkpoints.drain_step is not None:
            log.warning("drain undone at step %d: gradients of later steps are taken again", node.step)
            self._checkpoints.drain_step = None
        if self.pause_reason is None:
            return 0
        self.pause_reason = None
        log.warning("updates resumed")
        node.tell_workers({"paused": False, "reason": ""})
        return node.release_held_updates()

    def ask_to_leave(self, ranks: list[int], reason: str) -> list[int]:
        """Tell ranks of an elastic job to leave (a preemption notice from the operator); returns those told."""
        job = self._node.active_job
        if job is None:
            raise ValueError("no job is registered: there is nobody to ask to leave")
        bad = [rank for rank in ranks if not 0 <= rank < job.spec.world_size]
        if bad or not ranks:
            raise ValueError(f"ranks {bad or ranks} are not ranks of the job (width {job.spec.world_size})")
        told = []
        for rank in sorted(set(ranks)):
            record = self._node.ledger.ranks.get(rank)
            if record is not None and not record.left:
                self._node.tell_workers({"leave": reason or "asked by an operator"}, peers=[record.peer], rank=rank)
                told.append(rank)
        log.warning("asked rank(s) %s to leave the job: %s", told, reason or "asked by an operator")
        return told

    @property
    def hyper_overrides(self) -> HyperOverrides:
        """The hyperparameter overrides in force."""
        return self.overrides.hyper

    def set_overrides(self, overrides: HyperOverrides, origin: str = ADMIN) -> None:
        """Use ``overrides`` from the next update on; ``ValueError`` (state unchanged) if invalid."""
        self.overrides.set(overrides, origin)

    def override_list(self) -> list[dict]:
        """Every override in force (or waiting for the next step: max_grad_norm), with who set it and when."""
        return self.overrides.listing()

    @property
    def clip_override(self) -> float | None:
        """The operator's max_grad_norm (the one in force, or the one waiting for the next step)."""
        return self.overrides.clip_override

    @property
    def max_grad_norm(self) -> float | None:
        """The clipping threshold in force: the operator's override, else the job's."""
        job = self._node.active_job
        return self.overrides.max_grad_norm(job.spec if job is not None else None)

    def check_max_grad_norm(self, value: float | None) -> None:
        """``ValueError`` if ``value`` (``None``: back to the job's) cannot be used."""
        job = self._node.active_job
        self.overrides.check_max_grad_norm(value, job.spec if job is not None else None)

    def set_max_grad_norm(self, value: float | None, origin: str = ADMIN) -> None:
        """Clip at ``value`` from the next step on (now, if between steps)."""
        job = self._node.active_job
        self.overrides.set_max_grad_norm(value, job.spec if job is not None else None, between_steps=self._node.between_steps(), origin=origin)

    def last_applied(self) -> dict[int, AdamWHyper]:
        return self.overrides.last_applied()

    def workers(self) -> dict[int, float]:
        """Rank -> when it was last heard from (unix time)."""
        return {rank: record.last_seen for rank, record in sorted(self._node.ledger.ranks.items())}

    def status(self) -> dict:
        """A snapshot of the node for the admin service."""
        node = self._node
        job = node.active_job
        owned = sum(b.numel for b in job.owned.values()) if job else 0
        drain_step = self._checkpoints.drain_step
        return {
            "node_id": node.node_id,
            "data_address": node.address,
            "uptime_s": time.time() - node.started_at,
            "registered": job is not None,
            "step": node.step,
            "world_size": job.spec.world_size if job else 0,
            "buckets_owned": len(job.owned) if job else 0,
            "bytes_owned": 12 * owned,
            "bytes_in_ram": self._store.resident_bytes(),
            "bytes_on_disk": self._store.disk_bytes(),
            "workers": self.workers(),
            "last_step": node.clock.last,
            "paused": self.pause_reason,
            "non_finite": node.non_finite.snapshot(),
            "job_state": self.job_state(),
            "overrides": self.override_list(),
            "jobs_let_go": node.jobs_let_go,
            "update_path": self._update_paths.describe(),
            **self._morphs.snapshot(),
            "drain_step": -1 if drain_step is None else drain_step,
        }

    def job_state(self) -> str:
        """``idle``, ``training``, ``paused``, ``draining``, ``drained`` or ``finished`` (see the admin proto)."""
        node = self._node
        if node.active_job is None:
            return "idle"
        drain_step = self._checkpoints.drain_step
        if drain_step is not None:
            return "drained" if node.step >= drain_step and node.between_steps() else "draining"
        if node.finished_step is not None:
            return "finished"
        return "paused" if self.pause_reason is not None else "training"
