"""Which gradients of the open step the nodes refused as non-finite (``--non-finite refuse``), and which
buckets wait for them: this rank's refusals (pushed again on the retry) and other ranks' (told by a
NOTICE), so that a step raises once everything else is back instead of waiting for values that cannot
come."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

Refusal = tuple[str, int, int, int]
"""(node, bucket, step, non-finite values) of one refused push."""


class RefusedGradients:
    """Per step: this rank's refused buckets and every bucket blocked by a refused rank."""

    def __init__(self) -> None:
        self.refused: dict[int, Refusal] = {}  # bucket -> this rank's refusal
        self._blocked: dict[int, tuple[int, set[int]]] = {}  # bucket -> (step, ranks whose gradient was refused)
        self.collecting = False  # finish_step collects refusals and raises once; elsewhere one raises at once
        self.step_open = False  # finish_step raised: the next call continues the same step

    def new_step(self) -> None:
        """A step starts: nothing of the previous one blocks it."""
        self._blocked.clear()

    def retry(self, rank: int) -> None:
        """The open step's refused buckets go again: they no longer wait for ``rank``."""
        for bucket_id in self.refused:
            self._blocked.get(bucket_id, (0, set()))[1].discard(rank)
        self.refused.clear()
        self.step_open = False

    def record(self, bucket_id: int, refusal: Refusal, rank: int) -> None:
        """A node refused this rank's gradient of ``bucket_id``."""
        self.refused[bucket_id] = refusal
        self.note_blocked(bucket_id, refusal[2], rank)

    def note_blocked(self, bucket_id: int, step: int, rank: int) -> None:
        """A node refused ``rank``'s gradient of the bucket for ``step``."""
        entry = self._blocked.get(bucket_id)
        if entry is None or entry[0] != step:
            entry = self._blocked[bucket_id] = (step, set())
        entry[1].add(rank)

    def is_blocked(self, bucket_id: int, step: int) -> bool:
        """Whether the bucket's values of ``step`` wait for a rank whose gradient was refused."""
        entry = self._blocked.get(bucket_id)
        return entry is not None and entry[0] == step and bool(entry[1])

    def only_blocked_left(self, waiting: Iterable[int], steps: Mapping[int, int]) -> bool:
        """After a refusal of this rank's gradient: whether every bucket still missing waits for a refused one."""
        return bool(self.refused) and all(self.is_blocked(b, steps[b]) for b in waiting)

    def in_order(self) -> list[Refusal]:
        return [self.refused[b] for b in sorted(self.refused)]

    def clear(self) -> None:
        self.refused.clear()
        self._blocked.clear()

    def accounts(self, since_step: int) -> list[str]:
        """What a timeout says about buckets blocked by refused gradients (from ``since_step`` on)."""
        return [
            f"bucket {b} of step {step} waits for rank(s) {sorted(ranks)} to push again the gradient the node refused (NaN/inf)"
            for b, (step, ranks) in sorted(self._blocked.items())
            if ranks and step >= since_step
        ]
