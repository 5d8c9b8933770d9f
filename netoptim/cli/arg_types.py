"""argparse types shared by the ``netoptim`` subcommands: each turns bad input into a clear message."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from netoptim.launch.niceness import check_niceness


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be positive" if minimum == 1 else f"{value} must be >= {minimum}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def param_count(text: str) -> int:
    """A parameter count like 3B, 85M, 1.3e9 or 125000000."""
    scale = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
    stripped = text.strip().lower()
    factor = scale.get(stripped[-1:], 1)
    try:
        value = int(float(stripped[:-1] if factor > 1 else stripped) * factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count like 3B, 85M or 125000000") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def niceness(text: str) -> int:
    """An argparse type: a CPU niceness, -20 (most CPU) to 19 (least)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    try:
        return check_niceness(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (the OS picks) to 65535."""
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: ports go from 0 (the OS picks) to 65535")
    return value


def positive_int_list(text: str) -> list[int]:
    """Comma-separated positive integers: ``128,1024,4096``."""
    return [positive_int(part.strip()) for part in text.split(",")]


def size(text: str) -> int:
    """Bytes from ``1048576``, ``4MiB``, ``64MB``, ``2GiB``."""
    units = {"": 1, "b": 1, "kb": 10**3, "kib": 1 << 10, "mb": 10**6, "mib": 1 << 20, "gb": 10**9, "gib": 1 << 30}
    stripped = text.strip().lower()
    number = stripped.rstrip("abgikm")
    unit = stripped[len(number) :]
    try:
        value = int(float(number) * units[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4MiB or 1048576") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def size_or_zero(text: str) -> int:
    """:func:`size`, or ``0`` (off)."""
    return 0 if text.strip() == "0" else size(text)


def size_list(text: str) -> list[str]:
    """Model sizes of ``netoptim bench train``, comma-separated."""
    known = ("small", "base", "1b")
    sizes = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [size for size in sizes if size not in known]
    if not sizes or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes are a comma-separated list of {', '.join(known)}")
    return sizes


def choice_list(known: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """A comma-separated list of ``what``, each one of ``known`` (order kept, repeats dropped)."""

    def parse(text: str) -> list[str]:
        picked = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
        unknown = [item for item in picked if item not in known]
        if not picked or unknown:
            raise argparse.ArgumentTypeError(f"{text!r}: {what} are a comma-separated list of {', '.join(known)}")
        return picked

    return parse


def address(text: str) -> str:
    from transport import backend_for

    try:
        backend_for(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
