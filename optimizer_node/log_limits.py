"""Rate-limited log lines, for what a hostile or broken peer can make a node say over and over.

A peer that sends a thousand oversized messages a second must not write a thousand lines a second
to the node's log (disk, and the operator's attention): each kind of event is logged at most once
per interval, and the next line says how many were left out since the last one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_INTERVAL_S = 10.0
"""At most one line per key in this many seconds."""


@dataclass(slots=True)
class _KeyState:
    last_logged: float
    suppressed: int = 0


class RateLimitedLog:
    """Logs at most one line per key per ``interval_s``; suppressed lines are counted, not lost."""

    def __init__(self, logger: logging.Logger, interval_s: float = DEFAULT_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._keys: dict[str, _KeyState] = {}  # one entry per call site kind: a handful, never per peer

    def log(self, key: str, level: int, message: str, *args: object) -> bool:
        """Log ``message % args`` at ``level`` unless a line of ``key`` went out less than
        ``interval_s`` ago; returns whether it was logged."""
        now = self._clock()
        state = self._keys.get(key)
        if state is not None and now - state.last_logged < self._interval_s:
            state.suppressed += 1
            return False
        suppressed = 0 if state is None else state.suppressed
        self._keys[key] = _KeyState(now)
        if suppressed:
            message = f"{message} (and %d more like it in the last %.0f s, not logged)"
            args = (*args, suppressed, now - state.last_logged)  # type: ignore[union-attr]
        self._logger.log(level, message, *args)
        return True

    def suppressed(self, key: str) -> int:
        """Lines of ``key`` left out since its last logged one."""
        state = self._keys.get(key)
        return 0 if state is None else state.suppressed
