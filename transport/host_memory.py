"""Giving freed heap memory back to the operating system.

Workers in layer-wise mode and out-of-core nodes free megabytes of tensors all the time. glibc keeps
freed heap pages mapped (its mmap threshold grows with the sizes freed), so without a trim the
resident size creeps towards everything ever allocated, although little is held. A process that
allocates the same sizes every step keeps them instead (:class:`StepHeap`), and trims only where
its resident size creeps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

log = logging.getLogger(__name__)


@functools.cache
def _malloc_trim() -> object | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def trim_host_heap() -> None:
    """Give freed heap memory back to the OS (glibc only; elsewhere a no-op)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers
M_TRIM_THRESHOLD = -1


MALLOPT_MAX = 2**31 - 1
"""mallopt takes a C int: a larger value (a threshold of 2 GiB or more) is clamped to this, not let wrap
around (4 GiB would have become 0: trim at every free)."""


@functools.cache
def _mallopt() -> object | None:
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        return None
    if mallopt is not None:
        mallopt.argtypes = (ctypes.c_int, ctypes.c_int)  # an int out of range raises, never wraps
        mallopt.restype = ctypes.c_int
    return mallopt


def keep_freed_heap(max_bytes: int) -> bool:
    """Let up to ``max_bytes`` of freed memory at the top of the heap stay mapped (glibc only), for
    the next allocation to reuse without faulting its pages in again; :func:`trim_host_heap` still
    gives it back. Once :func:`map_large_allocations` has set a threshold, glibc trims every free
    of more than 128 KiB at the top at once: a layer-wise worker, which frees a unit's parameters and
    allocates the next one's, then copied into fresh pages at a quarter of the speed (measured: 2.5
    against 9 GB/s). Returns False where this is not glibc."""
    mallopt = _mallopt()
    return bool(mallopt is not None and mallopt(M_TRIM_THRESHOLD, min(max_bytes, MALLOPT_MAX)) == 1)


def kernel_choice(path: str) -> str | None:
    """The chosen word of a kernel setting that lists its choices with the chosen one in brackets
    (``always [madvise] never``, as ``/sys/kernel/mm/transparent_hugepage/*`` does); ``None`` where
    the file is not there or names none."""
    try:
        with open(path) as handle:
            words = handle.read().split()
    except OSError:
        return None
    chosen = [word[1:-1] for word in words if word.startswith("[") and word.endswith("]")]
    return chosen[0] if chosen else None


def map_large_allocations(threshold_bytes: int = 1 << 20) -> bool:
    """Serve every allocation of ``threshold_bytes`` or more with its own mapping, returned to the OS
    when freed (glibc only). glibc otherwise raises its threshold up to 32 MiB after large frees and
    serves later ones from the heap, where a process that streams megabyte tensors through (bucket
    state, gradient frames, parameters sent) keeps every byte it ever freed. Returns False where
    this is not glibc."""
    mallopt = _mallopt()
    return bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, min(threshold_bytes, MALLOPT_MAX)) == 1)


def resident_bytes() -> int:
    """This process's resident set size, in bytes (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class StepHeap:
    """Keeps what a step freed on the heap for the next step, which allocates the same sizes again,
    and trims the heap only where the resident size creeps past what the first step kept.

    Trimming after every step gives the pages back, and the next step faults every one of them in
    again (a layer-wise worker of an 85M GPT on CPU: ~60,000 faults, 0.07 s of CPU a step). Not
    trimming at all lets glibc's free lists drift (a slow creep, ~0.1 MB a step measured on a small
    GPT). Here the RSS after the ``settle_steps``-th step is the mark (the first steps still grow
    the heap as allocations find their places): a step that ends more than ``slack_bytes`` or an
    eighth of the mark (the larger) above it trims the heap, and the mark is set again as at the
    start."""

    def __init__(self, slack_bytes: int = 32 << 20, settle_steps: int = 3) -> None:
        if slack_bytes < 0:
            raise ValueError(f"slack_bytes must be at least 0, got {slack_bytes}")
        if settle_steps < 1:
            raise ValueError(f"settle_steps must be at least 1, got {settle_steps}")
        self.slack_bytes = slack_bytes
        self.settle_steps = settle_steps
        self._settling = 0  # steps since the start or the last trim, until the mark is set
        self._mark: int | None = None
        self.trims = 0  # trims done (counted for tests; each one logged at DEBUG)

    def step_done(self) -> bool:
        """Call once a step, after the step freed what it held; returns whether the heap was trimmed."""
        rss = resident_bytes()
        if self._mark is None:
            self._settling += 1
            if self._settling >= self.settle_steps:
                self._mark, self._settling = rss, 0
            return False
        if rss <= self._mark + max(self.slack_bytes, self._mark // 8):
            return False
        trim_host_heap()
        self.trims += 1
        log.debug("heap trimmed: %.0f MB resident after a step, %.0f MB at the mark; now %.0f MB", rss / 1e6, self._mark / 1e6, resident_bytes() / 1e6)
        self._mark = None
        return True


HEAP_FROM_BYTES = 32 << 20  # glibc's largest mmap threshold: what is smaller comes from the heap


def keep_step_heap(kept_bytes: int) -> StepHeap:
    """Set up this process's heap for a training loop that allocates and frees the same tensors every
    step (glibc only; elsewhere the settings are no-ops): allocations below 32 MiB (glibc's largest
    mmap threshold) come from the heap, up to ``kept_bytes`` freed at its top stay mapped, and the
    :class:`StepHeap` returned (call :meth:`StepHeap.step_done` once a step) trims the heap where
    the resident size creeps. The first step's pages are then reused by every later step, not
    faulted in again: glibc's own thresholds move with what was freed last, and a CPU worker of an
    85M GPT faulted 17,000-71,000 pages in a step with them, against ~10,000 (full model, measured)."""
    map_large_allocations(HEAP_FROM_BYTES)
    keep_freed_heap(max(HEAP_FROM_BYTES, kept_bytes))
    return StepHeap()
