"""What a moment format costs, without torch (the command line's planners read it)."""

from __future__ import annotations

MIN_COMPRESSED = 4096
"""Elements a segment needs at least to be kept compressed (bitsandbytes' and torchao's threshold)."""


def bytes_per_element(format: str, block: int) -> float:
    """Bytes of both moments per compressed element (the plan's count; small segments stay at 8)."""
    if format == "fp32":
        return 8.0
    if format == "bf16":
        return 4.0
    if format == "8bit":
        return 2.0 + 8.0 / block
    raise ValueError(f"moments {format!r} is not one of fp32, bf16, 8bit")
