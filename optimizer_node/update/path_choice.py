"""Which of a node's two update paths does its updates: the compiled one-pass loop or torch ops.

Both give the same bits (the loop is checked against torch's kernel before first use), but which is
faster depends on the host: the loop reads and writes memory once where torch ops make several
passes, and beat torch's fused kernel on 2 cores; on a 16-core host a node running the loop was
slower than one running torch ops (different jobs, one run each). So a node does not guess: the first
updates of each job alternate between the two paths, each timed from a bucket's third update on (its
first ones fault its fresh memory in), and once both have done enough work the faster does every
update from then on. Owned by the daemon; daemon thread only.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

from optimizer_node.update.kernels import compiled_update

log = logging.getLogger(__name__)

TRIAL_MIN_NUMEL = 1 << 16
"""Buckets smaller than this are not timed: their time is the calls' fixed cost, the same either way."""
TRIAL_NUMEL = 32 << 20
"""Elements each path updates in the trial (128 MiB of parameters: far beyond the caches)."""
TRIAL_MIN_UPDATES = 8
"""Updates each path does in the trial, at least: the median of their rates decides."""
WARM_UPDATES = 2
"""A bucket's first updates in this process are not timed: they fault in the pages of its moments and
of both its board slots, which costs more than the update itself (a node's first touch of fresh
memory) and falls on whichever path ran them. Timed from the first update, a node here took torch ops
as 6% faster where the loop was 13% faster from each bucket's third update on."""
TRIAL_MAX_UPDATES = 1024
"""Updates timed on torch ops with none through the loop (which does not take this job's updates,
e.g. with clipping every step): torch ops it is, and the trial keeps nothing more."""
COMPILED_MARGIN = 1.05
"""torch ops must be this much faster to be chosen: the loop's one pass leaves more memory bandwidth
to the other processes of the host, which a node's own timing does not see."""


@dataclass
class _Timed:
    numel: int = 0
    rates: list[float] = field(default_factory=list)  # Mparam/s of each update (bounded: the trial ends)

    @property
    def mparams_per_s(self) -> float:
        return statistics.median(self.rates) if self.rates else 0.0


class UpdatePathChoice:
    """The path each update asks for (:meth:`wants_compiled`), what each update took (:meth:`record`),
    and the choice made from it. ``enabled=False`` (an out-of-core node): torch ops throughout."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.compiled: _Timed = _Timed()
        self.torch_ops: _Timed = _Timed()
        self.chosen: str | None = None  # "compiled" or "torch-ops", once the trial is over
        self._updates_seen: dict[int, int] = {}  # bucket id -> its updates so far, during the trial

    def wants_compiled(self, bucket_id: int, step: int, numel: int) -> bool:
        """Whether the update of bucket ``bucket_id`` (``numel`` elements) at ``step`` should run through
        the compiled loop (which falls back to torch ops by itself where it does not take the update,
        or is not checked yet)."""
        if not self.enabled:
            return False
        if self.chosen is not None or numel < TRIAL_MIN_NUMEL:  # small buckets are not timed: the loop's one pass
            return self.chosen != "torch-ops"
        # In the trial each bucket takes the two paths in turn, step after step: where a bucket comes
        # in a step (the first overlaps the worker's pushes, the last has the cores alone) must not
        # favour one path.
        return (bucket_id + step) % 2 == 0

    def record(self, bucket_id: int, compiled: bool, numel: int, seconds: float) -> None:
        """One update of bucket ``bucket_id`` (``numel`` elements) took ``seconds`` on the path that ran
        (``compiled``)."""
        if self.chosen is not None or not self.enabled or numel < TRIAL_MIN_NUMEL:
            return
        seen = self._updates_seen[bucket_id] = self._updates_seen.get(bucket_id, 0) + 1
        if seen <= WARM_UPDATES or seconds <= 0 or not compiled_update.ready():
            return  # before the loop is ready every update runs on torch ops: nothing to compare
        timed = self.compiled if compiled else self.torch_ops
        timed.numel += numel
        timed.rates.append(numel / seconds / 1e6)
        if all(t.numel >= TRIAL_NUMEL and len(t.rates) >= TRIAL_MIN_UPDATES for t in (self.compiled, self.torch_ops)):
            faster_ops = self.torch_ops.mparams_per_s > COMPILED_MARGIN * self.compiled.mparams_per_s
            self._choose("torch-ops" if faster_ops else "compiled")
        elif len(self.torch_ops.rates) >= TRIAL_MAX_UPDATES and not self.compiled.rates:
            self._choose("torch-ops")

    def _choose(self, path: str) -> None:
        self.chosen = path
        self._updates_seen.clear()
        log.info("update path: %s (%s)", path, self._rates())

    def describe(self) -> str:
        """What updates run on now, for the admin status (see ``update_path`` in docs/operations.md)."""
        if not self.enabled:
            return "torch-ops (out of core)"
        if self.chosen is not None:
            return f"{self.chosen} ({self._rates()})"
        if compiled_update.ready() and (self.compiled.rates or self.torch_ops.rates):
            return "compiled and torch-ops in turn, timing both on this job's first updates"
        return compiled_update.path()

    def _rates(self) -> str:
        return (
            f"compiled loop {self.compiled.mparams_per_s:.0f} Mparam/s, torch ops {self.torch_ops.mparams_per_s:.0f} Mparam/s, "
            f"medians of this job's first {len(self.compiled.rates) + len(self.torch_ops.rates)} updates"
        )
