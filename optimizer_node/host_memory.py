"""Giving freed heap memory back to the operating system.

Workers in layer-wise mode and out-of-core nodes free megabytes of tensors all the time. glibc keeps
freed heap pages mapped (its mmap threshold grows with the sizes freed), so without a trim the
resident size creeps towards everything ever allocated, although little is held.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


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
