"""What the nodes tell a worker besides the values themselves: an operator's request that it leave
(elastic jobs), a job the nodes let go, the gradient norm of a clipped step, the steps they skipped
(``--non-finite skip``), and the newest step of values each node sent this process (what the checks
after a node's restart go by). :class:`NodeNews` keeps it; the session hands it each NOTICE and each
PARAMS header."""

from __future__ import annotations

import logging

from transport.wire import Header

log = logging.getLogger(__name__)


class NodeNews:
    """One worker's record of what its nodes told it."""

    def __init__(self) -> None:
        self.leave_requested: str | None = None  # an operator asked this worker to leave (elastic jobs), and why
        self.last_grad_norm: float | None = None
        self.last_skipped_step: int | None = None  # the last step the nodes skipped (--non-finite skip)
        self.skipped_steps = 0
        self._seen_step: dict[int, int] = {}  # node -> the newest step of values it sent this process

    def seen_step(self, index: int) -> int:
        """The newest step of values node ``index`` sent this process; -1 before any."""
        return self._seen_step.get(index, -1)

    def on_notice(self, address: str, header: Header, rank: int) -> bool:
        """A NOTICE from the node at ``address`` to this worker (``rank``): True where it was news for this record (a leave
        request); ``RuntimeError`` where the node let the job go. Other notices are the caller's."""
        leave = header.meta.get("leave")
        if isinstance(leave, str):  # an operator's preemption notice (netoptim admin morph --leave)
            if self.leave_requested is None:
                log.warning("rank %d: node %s asks this worker to leave the job: %s", rank, address, leave)
            self.leave_requested = leave
            return True
        dropped = header.meta.get("job_dropped")
        if isinstance(dropped, str):
            raise RuntimeError(
                f"node {address} let this job go: {dropped}. Rank {rank} stops; to go on, restart the node "
                "with --resume pointed at the archived checkpoints, then the workers"
            )
        return False

    def on_params(self, index: int, header: Header, rank: int) -> None:
        """A bucket's values from node ``index`` to this worker (``rank``): its step, and the norm or
        skip that came with them."""
        if header.step > self._seen_step.get(index, -1):
            self._seen_step[index] = header.step
        if "grad_norm" in header.meta:
            self.last_grad_norm = float(header.meta["grad_norm"])
        if header.meta.get("skipped") and self.last_skipped_step != header.step - 1:
            self.last_skipped_step = header.step - 1
            self.skipped_steps += 1
            log.warning("rank %d: the nodes skipped step %d (a gradient held NaN/inf; --non-finite skip): the parameters did not change", rank, header.step - 1)
