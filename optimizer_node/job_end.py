"""How a job ends on a node: :class:`JobEnd`, one a job.

A job is finished once every rank has closed its optimizer (BYE) and the node is between steps: its
final state is checkpointed, as at a node's exit. The finished job stays registered (a rank that
says HELLO again goes on with it) until the node lets it go, for the next job (``--next-job``) or on
an operator's reset: its last state checkpointed, its checkpoints archived, its ranks still
connected told.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from optimizer_node.intake.admission import job_fingerprint
from optimizer_node.state.checkpoint import archive_checkpoints
from transport.interface import Message
from transport.wire import Header, MsgType

if TYPE_CHECKING:
    from optimizer_node.admin.overrides import OperatorOverrides
    from optimizer_node.config import NodeConfig
    from optimizer_node.intake.rank_check import RankCheck
    from optimizer_node.job_state import ActiveJob, CurrentJob
    from optimizer_node.serving.replies import ParameterReplies
    from optimizer_node.state.persistence import Checkpoints

log = logging.getLogger(__name__)


class JobEnd:
    """The job's BYEs, the step at which it finished, and its side of being let go.

    ``current``: where the job stands; ``ranks``: who may send what; ``replies``: the job's batched
    values, sent before it is let go; ``overrides``: what an operator set for it, dropped with it;
    ``send``: how a message goes out; ``tell_workers``: a NOTICE to every rank of the job."""

    def __init__(
        self,
        config: NodeConfig,
        current: CurrentJob,
        ranks: RankCheck,
        replies: ParameterReplies,
        checkpoints: Checkpoints,
        overrides: OperatorOverrides,
        *,
        send: Callable[[bytes, Header], None],
        tell_workers: Callable[[dict], None],
    ) -> None:
        self._config = config
        self._current = current
        self._ranks = ranks
        self._send = send
        self._tell_workers = tell_workers
        self._replies = replies
        self._checkpoints = checkpoints
        self._overrides = overrides
        self.finished_step: int | None = None  # every rank said BYE between steps: the job is over at this step

    def on_bye(self, message: Message) -> None:
        """A rank closed its optimizer. When every rank has, between steps, the job is finished."""
        self._ranks.require_rank(message)
        current = self._current
        current.ledger.mark_left(message.header.rank)
        self._send(message.peer, Header(msg_type=MsgType.ACK, rank=message.header.rank, step=current.step, meta={"bye": True}))
        log.info("rank %d closed its optimizer at step %d", message.header.rank, current.step)
        self.check_finished()

    def check_finished(self) -> None:
        """The job is finished if every rank said BYE and the node is between steps."""
        current = self._current
        job = current.job
        if job is None or self.finished_step is not None or not current.ledger.all_left(job.spec.world_size) or not current.between_steps():
            return
        self.finished_step = current.step
        self._checkpoints.on_exit()  # the final state, as at a node's exit
        log.warning(
            "job %s finished at step %d: all %d ranks closed their optimizers; %s",
            job_fingerprint(job.spec),
            self.finished_step,
            job.spec.world_size,
            "the node takes the next job that says HELLO" if self._config.next_job == "take" else "netoptim admin reset lets the node take another",
        )

    def go_on(self) -> None:
        """A rank of the finished job said HELLO again: the job is not over."""
        self.finished_step = None

    def let_go(self, job: ActiveJob, reason: str) -> tuple[str, int, Path | None]:
        """The job's side of letting it go: its batched values sent, its last state checkpointed (between
        steps), its checkpoints moved to ``finished/<job>-step-<step>/`` under the checkpoint directory
        (:func:`~optimizer_node.state.checkpoint.archive_checkpoints`), its ranks still connected told, the
        checkpoints waited for cancelled. Returns the job's fingerprint, its step and where its
        checkpoints went."""
        step, fingerprint = self._current.step, job_fingerprint(job.spec)
        self._replies.flush()
        self._checkpoints.on_exit()
        archived = archive_checkpoints(Path(self._config.checkpoint_dir), f"job-{fingerprint}-step-{step:010d}") if self._config.checkpoint_dir else None
        self._tell_workers({"job_dropped": f"{reason}; its state at step {step} is {f'in {archived}' if archived else 'gone (no --checkpoint-dir)'}"})
        self._checkpoints.cancel_waiters(reason)
        if self._overrides.origins:
            log.warning("the job's hyperparameter overrides are dropped with it: %s", ", ".join(sorted(self._overrides.origins)))
        return fingerprint, step, archived
