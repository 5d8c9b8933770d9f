"""Job morphing on a node: the job's data-parallel width changes at a step boundary its workers agreed on.

Workers agree on the new membership and on the step it takes effect (:mod:`gpu_worker.elastic`), then
each says HELLO again with the new world size and ``morph_at``: that step. The node morphs on the
first such HELLO once every bucket it owns has reached that step, nothing of it applied yet: the
registered job takes the new width (the parameters and moments stay as they are, the gradients of the
following steps are averaged over the new width), the rank table starts over (the old registrations'
messages are refused from then on) and the other ranks' HELLOs of the new width register as usual. A
morph HELLO that comes early is held until the node reaches the step (the worker is told it waits).

Nothing of a step is ever applied with two widths: a node holds no gradient of the morph step from the
old width, because the workers morph before pushing it; should one be there (a worker that did not
follow the agreement), it is dropped, with a warning, rather than mixed in.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

from protos.job.spec import JobSpec
from transport.interface import Message
from transport.wire import ErrorCode, WireError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class MorphRecord:
    """What the last morph was, for status and metrics."""

    step: int
    from_world: int
    to_world: int
    unix_time: float
    dropped_gradients: int
    pause_s: float | None = None  # from the last update of the step before to the first gradient after


@dataclass(slots=True)
class MorphGate:
    """Morph HELLOs that came before the node reached their step, and the morphs done."""

    waiting: list[tuple[int, Message]] = field(default_factory=list)  # (morph step, HELLO)
    morphs: int = 0
    last: MorphRecord | None = None
    _last_update_at: float = 0.0  # perf_counter of the last update sent back, for the pause
    _awaiting_first_push: bool = False

    def requested_step(self, message: Message) -> int | None:
        """The ``morph_at`` of a HELLO (``None``: not a morph); BAD_REQUEST if it is not a step number."""
        at = message.header.meta.get("morph_at")
        if at is None:
            return None
        if not isinstance(at, int) or isinstance(at, bool) or at < 0:
            raise WireError(ErrorCode.BAD_REQUEST, f"bad HELLO: morph_at must be a step number, got {at!r}")
        return at

    @staticmethod
    def morphs_to(registered: JobSpec, spec: JobSpec) -> bool:
        """Whether ``spec`` is the registered job at another world size and nothing else."""
        return spec.world_size != registered.world_size and dataclasses.replace(spec, world_size=registered.world_size) == registered

    def hold(self, at: int, message: Message) -> None:
        self.waiting.append((at, message))

    def due(self, step: int) -> list[Message]:
        """The held HELLOs whose morph step the node has reached, in arrival order."""
        ready = [message for at, message in self.waiting if at <= step]
        self.waiting = [(at, message) for at, message in self.waiting if at > step]
        return ready

    def morphed(self, step: int, from_world: int, to_world: int, dropped: int) -> None:
        self.morphs += 1
        self.last = MorphRecord(step, from_world, to_world, time.time(), dropped)
        self._awaiting_first_push = True
        log.warning(
            "job morphed from %d to %d workers at step %d%s",
            from_world,
            to_world,
            step,
            f" ({dropped} gradient(s) of that step from the old width dropped)" if dropped else "",
        )

    def update_sent(self) -> None:
        self._last_update_at = time.perf_counter()

    def push_taken(self) -> None:
        """The first gradient after a morph closes its pause (called for every push: one bool test)."""
        if self._awaiting_first_push:
            self._awaiting_first_push = False
            if self.last is not None and self._last_update_at:
                self.last.pause_s = time.perf_counter() - self._last_update_at

    def snapshot(self) -> dict:
        last = self.last
        return {
            "morphs": self.morphs,
            "last_morph_step": -1 if last is None else last.step,
            "last_morph_from": 0 if last is None else last.from_world,
            "last_morph_pause_s": -1.0 if last is None or last.pause_s is None else last.pause_s,
        }
