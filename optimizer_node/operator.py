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
from transport.wire import Header, MsgType

if TYPE_CHECKING:
    import torch

    from optimizer_node.daemon import _BucketStep, _Job
    from optimizer_node.storage import BucketState, BucketStore

log = logging.getLogger(__name__)


class OperatorControls:
    """Operator actions on the daemon's state."""

    # State owned by NodeDaemon, used here.
    node_id: str
    address: str
    started_at: float
    clock: StepClock
    _job: _Job | None
    _store: BucketStore
    _peers: dict[int, bytes]
    _last_seen: dict[int, float]
    _in_flight: dict[int, _BucketStep]
    _overrides: HyperOverrides
    _last_applied: dict[int, AdamWHyper]
    _pause_reason: str | None
    _held: list[int]
    _stop: threading.Event | None

    if TYPE_CHECKING:  # provided by NodeDaemon

        @property
        def step(self) -> int: ...
        def _apply(self, job: _Job, state: BucketState, in_flight: _BucketStep, clip: torch.Tensor | None, grad_norm: float | None = None) -> None: ...
        def _maybe_request_norm(self, job: _Job) -> None: ...
        def _send(self, peer: bytes, header: Header, payload: torch.Tensor | None = None) -> None: ...

    def pause(self, reason: str) -> int:
        """Stop applying updates (gradients still arrive and are summed); tells every worker why."""
        self._pause_reason = reason or "paused by the operator"
        log.warning("updates paused: %s", self._pause_reason)
        self._notify_workers({"paused": True, "reason": self._pause_reason})
        return self.step

    def resume(self) -> int:
        """Apply what was held and go on; returns how many buckets were updated now."""
        if self._pause_reason is None:
            return 0
        self._pause_reason = None
        log.warning("updates resumed")
        self._notify_workers({"paused": False, "reason": ""})
        job = self._job
        held, self._held = self._held, []
        if job is None:
            return 0
        if job.spec.max_grad_norm is not None:
            self._maybe_request_norm(job)
            return 0
        for bucket_id in held:
            state = self._store.get(bucket_id)
            assert state is not None
            self._apply(job, state, self._in_flight[bucket_id], clip=None)
        return len(held)

    def _notify_workers(self, meta: dict) -> None:
        for peer in self._peers.values():
            self._send(peer, Header(msg_type=MsgType.NOTICE, step=self.step, meta=meta))

    @property
    def paused(self) -> str | None:
        return self._pause_reason

    @property
    def overrides(self) -> HyperOverrides:
        return self._overrides

    def set_overrides(self, overrides: HyperOverrides) -> None:
        """Use ``overrides`` from the next update on; ``ValueError`` (state unchanged) if invalid."""
        overrides.validate()
        self._overrides = overrides
        log.warning("hyperparameter overrides now %s", overrides)

    def last_applied(self) -> dict[int, AdamWHyper]:
        return dict(self._last_applied)

    def workers(self) -> dict[int, float]:
        """Rank -> when it was last heard from (unix time)."""
        return dict(sorted(self._last_seen.items()))

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
            "bytes_owned": 16 * owned,
            "bytes_in_ram": sum(state.state_bytes for state in states),
            "bytes_on_disk": 0,
            "workers": self.workers(),
            "last_step": self.clock.last,
            "paused": self._pause_reason,
        }

    def request_stop(self) -> None:
        """Stop the serve loop after the current message."""
        if self._stop is not None:
            self._stop.set()
