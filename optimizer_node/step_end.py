"""What a node does once every owned bucket reached a step: :class:`StepEnd`, one a job.

The step's timings go to the clock and the metrics, the overrides an operator set during the step
come into force, a checkpoint that is due is written, the job is finished if every rank said BYE, and
the width change the workers agreed on for this step is made. After the job's first step its
long-lived objects are kept out of the garbage collector's scans until the job is let go.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TYPE_CHECKING

from transport.interface import Message

if TYPE_CHECKING:
    from optimizer_node.admin.overrides import OperatorOverrides
    from optimizer_node.control import StepClock
    from optimizer_node.intake.morphing import MorphGate
    from optimizer_node.job_end import JobEnd
    from optimizer_node.metrics import NodeMetrics
    from optimizer_node.state.persistence import Checkpoints


class StepEnd:
    """The end of each step of one job. ``handle``: the node's handling of a message (a morph HELLO
    held for this step)."""

    def __init__(
        self,
        handle: Callable[[Message], None],
        clock: StepClock,
        metrics: NodeMetrics,
        overrides: OperatorOverrides,
        checkpoints: Checkpoints,
        job_end: JobEnd,
        morphs: MorphGate,
    ) -> None:
        self._handle = handle
        self._clock = clock
        self._metrics = metrics
        self._overrides = overrides
        self._checkpoints = checkpoints
        self._job_end = job_end
        self._morphs = morphs
        self.gc_frozen = False  # the job's long-lived objects are out of the collector's scans

    def finish(self, step: int) -> None:
        """Every owned bucket reached ``step``: the step's timings, and its checkpoint if one is due."""
        if not self.gc_frozen:  # the job's long-lived objects (states, plan, tensors): out of the collector's scans
            gc.freeze()
            self.gc_frozen = True
        self._clock.step_completed(step)
        self._metrics.step_completed(self._clock.last, step)
        self._overrides.step_begins()
        self._checkpoints.step_completed(step)
        self._job_end.check_finished()  # a rank's BYE can overtake its last pushes (on another of its connections)
        self._morphs.update_sent()
        for held in self._morphs.due(step):  # the workers agreed to morph at this step
            self._handle(held)
