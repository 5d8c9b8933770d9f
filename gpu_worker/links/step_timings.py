"""Where a worker's time in the offload session went, phase by phase."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(slots=True)
class WorkerStepTimings:
    """Seconds spent in each phase since the timings were last taken (normally: one step)."""

    gather_s: float = 0.0  # gradients copied into send buffers (device-to-host included)
    send_s: float = 0.0  # pushes handed to the transport
    wait_s: float = 0.0  # waiting for the nodes, with nothing else to do
    install_s: float = 0.0  # received values copied into the parameters
    pushes: int = 0
    installs: int = 0


def elapsed(since: float) -> float:
    """Seconds from ``since`` (a ``time.perf_counter()`` reading) to now."""
    return time.perf_counter() - since
