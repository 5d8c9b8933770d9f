"""Importing an optional framework, with an error that says how to install it."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRA_HINT = "pip install 'netoptim-train[integrations]'"
"""The command that installs every framework the integrations support."""


def require(module: str, *, by: str) -> ModuleType:
    """Import ``module`` for the integration ``by``; ``ImportError`` naming the extra when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".", 1)[0]
        raise ImportError(f"{by} needs the package {top!r}, which is not installed: {EXTRA_HINT} (or pip install {top})") from exc
