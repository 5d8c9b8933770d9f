"""How a job ends on a node: :class:`JobEnd`, one a job.

A job is finished once every rank has closed its optimizer (BYE) and the node is between steps: its
final state is checkpointed, as at a node's exit. The finished job stays registered (a rank that
says HELLO again goes on with it) until the node lets it go, for the next job (``--next-job``) or on
an operator's reset: its last state checkpointed, its checkpoints archived, its ranks still
connected told.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from optimizer_node.intake.admission import job_fingerprint
from optimizer_node.job_state import JobNode
from optimizer_node.state.checkpoint import archive_checkpoints
from transport.interface import Message
from transport.wire import Header, MsgType

if TYPE_CHECKING:
    from optimizer_node.admin.overrides import OperatorOverrides
    from optimizer_node.config import NodeConfig
    from optimizer_node.intake.registration import JobRegistrar
    from optimizer_node.job_state import ActiveJob
    from optimizer_node.serving.outgoing import Outgoing
    from optimizer_node.serving.replies import ParameterReplies
    from optimizer_node.state.persistence import Checkpoints

log = logging.getLogger(__name__)


class EndingNode(JobNode, Protocol):
    """What :class:`JobEnd` reads and asks of the daemon, besides :class:`JobNode`."""

    def between_steps(self) -> bool: ...
    def tell_workers(self, meta: dict, *, peers: Iterable[bytes] | None = None, rank: int = -1) -> None: ...


class JobEnd:
    """The job's BYEs, the step at which it finished, and its side of being let go.

    ``replies``: the job's batched values, sent before it is let go; ``overrides``: what an operator
    set for it, dropped with it."""

    def __init__(
        self,
        node: EndingNode,
        config: NodeConfig,
        registrar: JobRegistrar,
        outgoing: Outgoing,
        replies: ParameterReplies,
        checkpoints: Checkpoints,
        overrides: OperatorOverrides,
    ) -> None:
        self._node = node
        self._config = config
        self._registrar = registrar
        self._outgoing = outgoing
        self._replies = replies
        self._checkpoints = checkpoints
        self._overrides = overrides
        self.finished_step: int | None = None  # every rank said BYE between steps: the job is over at this step

    def on_bye(self, message: Message) -> None:
        """A rank closed its optimizer. When every rank has, between steps, the job is finished."""
        self._registrar.require_rank(message)
        node = self._node
        node.ledger.mark_left(message.header.rank)
        self._outgoing.send(message.peer, Header(msg_type=MsgType.ACK, rank=message.header.rank, step=node.step, meta={"bye": True}))
        log.info("rank %d closed its optimizer at step %d", message.header.rank, node.step)
        self.check_finished()

    def check_finished(self) -> None:
        """The job is finished if every rank said BYE and the node is between steps."""
        node = self._node
        job = node.active_job
        if job is None or self.finished_step is not None or not node.ledger.all_left(job.spec.world_size) or not node.between_steps():
            return
        self.finished_step = node.step
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
        step, fingerprint = self._node.step, job_fingerprint(job.spec)
        self._replies.flush()
        self._checkpoints.on_exit()
        archived = archive_checkpoints(Path(self._config.checkpoint_dir), f"job-{fingerprint}-step-{step:010d}") if self._config.checkpoint_dir else None
        self._node.tell_workers({"job_dropped": f"{reason}; its state at step {step} is {f'in {archived}' if archived else 'gone (no --checkpoint-dir)'}"})
        self._checkpoints.cancel_waiters(reason)
        if self._overrides.origins:
            log.warning("the job's hyperparameter overrides are dropped with it: %s", ", ".join(sorted(self._overrides.origins)))
        return fingerprint, step, archived
