"""Deliberate crash points, for testing that a node killed at the worst moment loses nothing.

``--crash-at POINT:N`` makes the node exit abruptly (``os._exit``, as a kill -9 would: no cleanup,
no checkpoint) the N-th time it passes POINT. Points: ``push`` (a gradient accepted, its step not
yet applied), ``update`` (a bucket updated, the step not complete), ``checkpoint`` (a bucket file of
a checkpoint written, the manifest not yet).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

POINTS = ("push", "update", "checkpoint")
EXIT_STATUS = 86


class CrashPoints:
    """Counts passes through named points and exits at the configured one."""

    def __init__(self, spec: str | None) -> None:
        self._point: str | None = None
        self._remaining = 0
        if spec:
            point, _, count = spec.partition(":")
            if point not in POINTS or not count.isdigit() or int(count) < 1:
                raise ValueError(f"crash point {spec!r} must be POINT:N with POINT one of {', '.join(POINTS)} and N >= 1")
            self._point, self._remaining = point, int(count)

    def passed(self, point: str) -> None:
        if point != self._point:
            return
        self._remaining -= 1
        if self._remaining == 0:
            log.error("crash point %s reached: exiting abruptly", point)
            os._exit(EXIT_STATUS)
