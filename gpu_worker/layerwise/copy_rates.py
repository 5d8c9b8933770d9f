"""The host-device copy rates that bound an offloaded step: one large copy each way from page-locked
memory, and host to device from pageable memory (``netoptim bench gpu``'s limits, ``netoptim
doctor``'s GPU check)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(run: Callable[[], object], repeats: int, synchronize: Callable[[], None]) -> float:
    """Median seconds of ``run`` over ``repeats`` timed calls after one untimed, ``synchronize`` around each."""
    times = []
    for _ in range(repeats + 1):  # the first warms up
        synchronize()
        started = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """GB/s of one large copy: pinned host to device, device to pinned host, pageable host to device."""
    numel = nbytes // 4
    pinned = torch.empty(numel, pin_memory=device.type == "cuda").uniform_()
    pageable = torch.empty(numel).uniform_()
    on_device = torch.empty(numel, device=device)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return {
        "pinned_h2d_gbs": nbytes / 1e9 / median_seconds(lambda: on_device.copy_(pinned, non_blocking=True), repeats, synchronize),
        "pinned_d2h_gbs": nbytes / 1e9 / median_seconds(lambda: pinned.copy_(on_device, non_blocking=True), repeats, synchronize),
        "pageable_h2d_gbs": nbytes / 1e9 / median_seconds(lambda: on_device.copy_(pageable), repeats, synchronize),
    }
