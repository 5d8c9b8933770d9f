"""What an operator can do to a running node (pause, resume, override hyperparameters, ask ranks to
leave, stop) and what it can see (status, workers): :class:`NodeOperator`, one a job
(:class:`~optimizer_node.job.NodeJob`). It owns what the operator set (the pause, the hyperparameter
overrides) and reads the rest from the job's parts; it runs on the node's thread only: the admin
service reaches it through the node's command queue.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from optimizer_node.admin.overrides import ADMIN, OperatorOverrides
from optimizer_node.moments.codec import describe_moments
from optimizer_node.update.adamw import AdamWHyper, HyperOverrides

if TYPE_CHECKING:
    from optimizer_node.intake.morphing import MorphGate
    from optimizer_node.job_end import JobEnd
    from optimizer_node.job_state import CurrentJob
    from optimizer_node.state.persistence import Checkpoints
    from optimizer_node.update.path_choice import UpdatePathChoice

log = logging.getLogger(__name__)


TellWorkers = Callable[..., None]
"""A NOTICE to the job's ranks: ``tell_workers(meta, *, peers=None, rank=-1)`` (every rank's connection: ``peers`` None)."""


class NodeOperator:
    """Operator actions on one job's node, and the node's status.

    ``current``: where the job stands; ``overrides``: the job's, which checkpoints save too;
    ``checkpoints`` (the drain), ``job_end``, ``morphs``, ``update_paths``: the job's parts, read for
    the status; ``tell_workers``: a NOTICE to the job's ranks; ``release_held``: after a pause, applies
    the updates held (returns how many); ``node_status``: what the status says of the node itself (its
    id, address, uptime, last step, non-finite counts, jobs let go)."""

    def __init__(
        self,
        current: CurrentJob,
        overrides: OperatorOverrides,
        *,
        checkpoints: Checkpoints,
        job_end: JobEnd,
        morphs: MorphGate,
        update_paths: UpdatePathChoice,
        tell_workers: TellWorkers,
        release_held: Callable[[], int],
        node_status: Callable[[], dict],
    ) -> None:
        self._current = current
        self.overrides = overrides  # hyperparameter overrides and the clipping threshold an operator set, with their origins
        self.pause_reason: str | None = None  # set while an operator has paused updates
        self._job_end = job_end
        self._tell_workers = tell_workers
        self._release_held = release_held
        self._node_status = node_status
        self._checkpoints = checkpoints
        self._morphs = morphs
        self._update_paths = update_paths

    def pause(self, reason: str) -> int:
        """Stop applying updates (gradients still arrive and are summed); tells every worker why."""
        self.pause_reason = reason or "paused by the operator"
        log.warning("updates paused: %s", self.pause_reason)
        self._tell_workers({"paused": True, "reason": self.pause_reason})
        return self._current.step

    def resume(self) -> int:
        """Undo a pause (apply the updates held and go on) and a drain (take gradients of later steps
        again); returns how many buckets were updated now."""
        if self._checkpoints.drain_step is not None:
            log.warning("drain undone at step %d: gradients of later steps are taken again", self._current.step)
            self._checkpoints.drain_step = None
        if self.pause_reason is None:
            return 0
        self.pause_reason = None
        log.warning("updates resumed")
        self._tell_workers({"paused": False, "reason": ""})
        return self._release_held()

    def ask_to_leave(self, ranks: list[int], reason: str) -> list[int]:
        """Tell ranks of an elastic job to leave (a preemption notice from the operator); returns those told."""
        job = self._current.job
        if job is None:
            raise ValueError("no job is registered: there is nobody to ask to leave")
        bad = [rank for rank in ranks if not 0 <= rank < job.spec.world_size]
        if bad or not ranks:
            raise ValueError(f"ranks {bad or ranks} are not ranks of the job (width {job.spec.world_size})")
        told = []
        for rank in sorted(set(ranks)):
            record = self._current.ledger.ranks.get(rank)
            if record is not None and not record.left:
                self._tell_workers({"leave": reason or "asked by an operator"}, peers=[record.peer], rank=rank)
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
        job = self._current.job
        return self.overrides.max_grad_norm(job.spec if job is not None else None)

    def check_max_grad_norm(self, value: float | None) -> None:
        """``ValueError`` if ``value`` (``None``: back to the job's) cannot be used."""
        job = self._current.job
        self.overrides.check_max_grad_norm(value, job.spec if job is not None else None)

    def set_max_grad_norm(self, value: float | None, origin: str = ADMIN) -> None:
        """Clip at ``value`` from the next step on (now, if between steps)."""
        job = self._current.job
        self.overrides.set_max_grad_norm(value, job.spec if job is not None else None, between_steps=self._current.between_steps(), origin=origin)

    def last_applied(self) -> dict[int, AdamWHyper]:
        return self.overrides.last_applied()

    def workers(self) -> dict[int, float]:
        """Rank -> when it was last heard from (unix time)."""
        return {rank: record.last_seen for rank, record in sorted(self._current.ledger.ranks.items())}

    def status(self) -> dict:
        """A snapshot of the node for the admin service."""
        current = self._current
        job = current.job
        drain_step = self._checkpoints.drain_step
        store = current.store
        return {
            **self._node_status(),
            "registered": job is not None,
            "step": current.step,
            "world_size": job.spec.world_size if job else 0,
            "buckets_owned": len(job.owned) if job else 0,
            "bytes_owned": job.state_bytes if job else 0,
            "moments": describe_moments(job.spec) if job else "",
            "bytes_in_ram": store.resident_bytes(),
            "bytes_on_disk": store.disk_bytes(),
            "workers": self.workers(),
            "paused": self.pause_reason,
            "job_state": self.job_state(),
            "overrides": self.override_list(),
            "update_path": self._update_paths.describe(),
            **self._morphs.snapshot(),
            "drain_step": -1 if drain_step is None else drain_step,
        }

    def job_state(self) -> str:
        """``idle``, ``training``, ``paused``, ``draining``, ``drained`` or ``finished`` (see the admin proto)."""
        current = self._current
        if current.job is None:
            return "idle"
        drain_step = self._checkpoints.drain_step
        if drain_step is not None:
            return "drained" if current.step >= drain_step and current.between_steps() else "draining"
        if self._job_end.finished_step is not None:
            return "finished"
        return "paused" if self.pause_reason is not None else "training"
