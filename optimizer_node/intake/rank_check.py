"""Who may send what in one job: a registered rank on its own connection (with CURVE, *and* its
key): :class:`RankCheck`, one a job, asked by every part that takes a rank's message."""

from __future__ import annotations

import logging
from collections.abc import Callable

from optimizer_node.job_state import ActiveJob, CurrentJob
from optimizer_node.log_limits import RateLimitedLog
from transport.interface import Message
from transport.wire import ErrorCode, WireError

log = logging.getLogger(__name__)


def _unregistered_text(rank: int) -> str:
    """What a connection that is not ``rank`` is told: the same whatever the reason, so that it learns
    nothing about who is registered (the node logs the reason)."""
    return (
        f"this connection is not registered as rank {rank}: it has not said HELLO, or another process has registered as rank {rank} since "
        "and this one is no longer part of the job"
    )


class RankCheck:
    """Who may send what in one job: a registered rank on its own connection (with CURVE, *and* its
    key). ``jobs_let_go``: how many jobs the node let go (node-wide: what a stray rank is told)."""

    def __init__(self, current: CurrentJob, limit_log: RateLimitedLog, *, jobs_let_go: Callable[[], int]) -> None:
        self._current = current
        self._limit_log = limit_log
        self._jobs_let_go = jobs_let_go

    def require_job(self) -> ActiveJob:
        """The registered job; NOT_REGISTERED (saying how a job registers) without one."""
        job = self._current.job
        if job is None:
            if self._jobs_let_go():  # a rank of a job the node let go (reset, or finished and replaced)
                raise WireError(ErrorCode.NOT_REGISTERED, "no job is registered: this node let its previous job go; rank 0 must say HELLO first")
            raise WireError(ErrorCode.NOT_REGISTERED, "no job is registered yet: rank 0 must say HELLO first")
        return job

    def is_registered(self, message: Message) -> bool:
        """Whether the message comes from the current connection (and key) of the rank it names."""
        return self._current.ledger.is_current(message.header.rank, message.peer, message.user_id)

    def require_rank(self, message: Message) -> ActiveJob:
        """The job, where the message comes from the registered connection of its rank; NOT_REGISTERED
        (the same words whatever the reason) otherwise."""
        job = self.require_job()
        rank = message.header.rank
        if not self.is_registered(message):
            ledger = self._current.ledger
            record = ledger.ranks.get(rank)
            if record is not None and record.peer == message.peer:  # another key on the rank's routing id
                self._limit_log.log("rank-taken-over", logging.WARNING, "key %s: %s", (message.user_id or "none")[:8], ledger.describe(rank, message.peer))
            else:
                log.debug("not rank %d: %s", rank, ledger.describe(rank, message.peer))
            raise WireError(ErrorCode.NOT_REGISTERED, _unregistered_text(rank))
        return job
