"""The box's limits from an earlier ``netoptim bench gpu --out`` file (``--limits-from``): a later run
on the same box reports each mode's fraction of the offload limit without measuring them again
(30-60 s of a GPU machine's time). Without torch, so that the command line checks the file itself."""

from __future__ import annotations

import json
import math
from pathlib import Path

NEEDED = ("pinned_h2d_gbs", "pinned_d2h_gbs", "cpu_adamw_mparams_per_s")
"""What the offload limit is computed from (:func:`netoptim.benchmarks.gpu.limits.offload_limit_step_s`)."""


def load_limits(path: str) -> dict:
    """The ``limits`` of the report at ``path``, with ``from`` (the path) and ``measured_on`` (the
    report's GPU and CPU count, for :func:`check_same_box`); ``ValueError`` that says what is wrong
    when the file cannot be read or holds no measured limits."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the limits of {path}: {exc}") from None
    limits = report.get("limits") if isinstance(report, dict) else None
    if not isinstance(limits, dict):
        raise ValueError(f"{path} is not a `netoptim bench gpu --out` report: it has no limits")
    bad = [key for key in NEEDED if not isinstance(limits.get(key), int | float) or not math.isfinite(limits[key]) or limits[key] <= 0]
    if bad:
        why = limits.get("status", "its run measured none, or they failed")
        raise ValueError(f"{path} holds no measured limits ({', '.join(bad)} missing: {why}); run `netoptim bench gpu` with --limits on this box first")
    return {**limits, "from": str(path), "measured_on": {"gpu": report.get("gpu"), "cpu_cores": report.get("cpu_cores")}}


def check_same_box(limits: dict, gpu: str, cpu_cores: int | None) -> None:
    """``ValueError`` unless ``limits`` (:func:`load_limits`) were measured with this GPU and CPU count:
    limits of another kind of box would give fractions of a limit that is not this box's."""
    measured_on = limits.get("measured_on", {})
    if (measured_on.get("gpu"), measured_on.get("cpu_cores")) != (gpu, cpu_cores):
        raise ValueError(
            f"--limits-from {limits.get('from')}: its limits were measured on {measured_on.get('gpu')} with {measured_on.get('cpu_cores')} CPUs, "
            f"this box is {gpu} with {cpu_cores}; measure this box's (drop --limits-from)"
        )
