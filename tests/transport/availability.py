"""Whether the optional Mooncake transport can run here (CI installs it: netoptim[rdma] + system libraries)."""

from __future__ import annotations

import importlib

import pytest

from transport.mooncake_link import INSTALL_HINT


def mooncake_importable() -> bool:
    try:
        importlib.import_module("mooncake.engine")
    except ImportError:
        return False
    return True


requires_mooncake = pytest.mark.skipif(not mooncake_importable(), reason=INSTALL_HINT)
