"""What an operator can do to a running node (pause, resume, override hyperparameters, stop) and
what it can see (status, workers). A mixin of :class:`~optimizer_node.daemon.NodeDaemon`: these
methods use the daemon's state, so they run on the daemon thread only; the admin service reaches them
through the daemon's command queue.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from optimizer_node.adamw import AdamWHyper, HyperOverrides
from optimizer_node.control import StepClock
from optimizer_node.overrides import ADMIN, OperatorOverrides
from transport.wire import Header, MsgType

if TYPE_CHECKING:
    import torch

    from optimizer_node.job_state import ActiveJob, BucketStep
    from optimizer_node.morphing import MorphGate
    from optimizer_node.non_finite import NonFiniteStats
    from optimizer_node.persistence import Checkpoints
    from optimizer_node.step_ledger import StepLedger
    from optimizer_node.storage import BucketStore
    from optimizer_node.update_path_choice import UpdatePathChoice

log = logging.getLogger(__name__)


class OperatorControls:
    """Operator actions on the daemon's state."""

    # State owned by NodeDaemon, used here.
    node_id: str
    address: str
    started_at: float
    clock: StepClock
    _job: ActiveJob | None
    _store: BucketStore
    _ledger: StepLedger
    _in_flight: dict[int, BucketStep]
    _overrides: OperatorOverrides
    _pause_reason: str | None
    _checkpoints: Checkpoints
    _ready: list[int]
    _stop: threading.Event | None
    _finished_step: int | None
    jobs_let_go: int
    _morphs: MorphGate
    non_finite: NonFiniteStats
    _update_paths: UpdatePathChoice

    if TYPE_CHECKING:  # provided by NodeDaemon

        @property
        def step(self) -> int: ...
        @property
        def _global_round(self) -> bool: ...
        def _maybe_request_norm(self, job: ActiveJob) -> None: ...
        def apply_all_ready(self) -> int: ...
        def _send(self, peer: bytes, header: Header, payload: torch.Tensor | None = None) -> None: ...
        def between_steps(self) -> bool: ...

    def pause(self, reason: str) -> int:
        """Stop applying updates (gradients still arrive and are summed); tells every worker why."""
        self._pause_reason = reason or "paused by the operator"
        log.warning("updates paused: %s", self._pause_reason)
        self._notify_workers({"paused": True, "reason": self._pause_reason})
        return self.step

    def resume(self) -> int:
        """Undo a pause (apply the updates held and go on) and a drain (take gradients of later steps
        again); returns how many buckets were updated now."""
        if self._checkpoints.drain_step is not None:
            log.warning("drain undone at step %d: gradients of later steps are taken again", self.step)
            self._checkpoints.drain_step = None
        if self._pause_reason is None:
            return 0
        self._pause_reason = None
        log.warning("updates resumed")
        self._notify_workers({"paused": False, "reason": ""})
        job = self._job
        if job is None:
            return 0
        if self._global_round and not self._ready:
            self._maybe_request_norm(job)
        return self.apply_all_ready()

    def ask_to_leave(self, ranks: list[int], reason: str) -> list[int]:
        """Tell ranks of an elastic job to leave (a preemption notice from the operator); returns those told."""
        if self._job is None:
            raise ValueError("no job is registered: there is nobody to ask to leave")
        bad = [rank for rank in ranks if not 0 <= rank < self._job.spec.world_size]
        if bad or not ranks:
            raise ValueError(f"ranks {bad or ranks} are not ranks of the job (width {self._job.spec.world_size})")
        told = []
        for rank in sorted(set(ranks)):
            record = self._ledger.ranks.get(rank)
            if record is not None and not record.left:
                self._send(record.peer, Header(msg_type=MsgType.NOTICE, rank=rank, step=self.step, meta={"leave": reason or "asked by an operator"}))
                told.append(rank)
        log.warning("asked rank(s) %s to leave the job: %s", told, reason or "asked by an operator")
        return told

    def _notify_workers(self, meta: dict) -> None:
        for peer in self._ledger.connections():
            self._send(peer, Header(msg_type=MsgType.NOTICE, step=self.step, meta=meta))

    @property
    def paused(self) -> str | None:
        return self._pause_reason

    @property
    def overrides(self) -> HyperOverrides:
        return self._overrides.hyper

    def set_overrides(self, overrides: HyperOverrides, origin: str = ADMIN) -> None:
        """Use ``overrides`` from the next update on; ``ValueError`` (state unchanged) if invalid."""
        self._overrides.set(overrides, origin)

    def override_list(self) -> list[dict]:
        """Every override in force (or waiting for the next step: max_grad_norm), with who set it and when."""
        return self._overrides.listing()

    @property
    def clip_override(self) -> float | None:
        """The operator's max_grad_norm (the one in force, or the one waiting for the next step)."""
        return self._overrides.clip_override

    @property
    def max_grad_norm(self) -> float | None:
        """The clipping threshold in force: the operator's override, else the job's."""
        return self._overrides.max_grad_norm(self._job.spec if self._job is not None else None)

    def check_max_grad_norm(self, value: float | None) -> None:
        """``ValueError`` if ``value`` (``None``: back to the job's) cannot be used."""
        self._overrides.check_max_grad_norm(value, self._job.spec if self._job is not None else None)

    def set_max_grad_norm(self, value: float | None, origin: str = ADMIN) -> None:
        """Clip at ``value`` from the next step on (now, if between steps)."""
        self._overrides.set_max_grad_norm(value, self._job.spec if self._job is not None else None, between_steps=self.between_steps(), origin=origin)

    def last_applied(self) -> dict[int, AdamWHyper]:
        return self._overrides.last_applied()

    def workers(self) -> dict[int, float]:
        """Rank -> when it was last heard from (unix time)."""
        return {rank: record.last_seen for rank, record in sorted(self._ledger.ranks.items())}

    def status(self) -> dict:
        """A snapshot of the node for the admin service."""
        states = list(self._store)
        owned = sum(b.numel for b in self._job.owned.values()) if self._job else 0
        return {
            "node_id": self.node_id,
            "data_address": self.address,
            "uptime_s": time.time() - self.started_at,
            "registered": self._job is not None,
            "step": self.step,
            "world_size": self._job.spec.world_size if self._job else 0,
            "buckets_owned": len(self._job.owned) if self._job else 0,
            "bytes_owned": 12 * owned,
            "bytes_in_ram": sum(state.state_bytes for state in states),
            "bytes_on_disk": 0,
            "workers": self.workers(),
            "last_step": self.clock.last,
            "paused": self._pause_reason,
            "non_finite": self.non_finite.snapshot(),
            "job_state": self.job_state(),
            "overrides": self.override_list(),
            "jobs_let_go": self.jobs_let_go,
            "update_path": self._update_paths.describe(),
            **self._morphs.snapshot(),
            "drain_step": -1 if self._checkpoints.drain_step is None else self._checkpoints.drain_step,
        }

    def job_state(self) -> str:
        """``idle``, ``training``, ``paused``, ``draining``, ``drained`` or ``finished`` (see the admin proto)."""
        if self._job is None:
            return "idle"
        drain_step = self._checkpoints.drain_step
        if drain_step is not None:
            return "drained" if self.step >= drain_step and self.between_steps() else "draining"
        if self._finished_step is not None:
            return "finished"
        return "paused" if self._pause_reason is not None else "training"

    def request_stop(self) -> None:
        """Stop the serve loop after the current message."""
        if self._stop is not None:
            self._stop.set()
