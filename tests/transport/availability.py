"""Whether the optional Mooncake transport can run here (CI installs it: netoptim-train[rdma] + system libraries).

A missing Mooncake fails its tests with the install hint instead of skipping them in silence; set
``NETOPTIM_SKIP_MOONCAKE=1`` to skip them on purpose (a machine that cannot install the libraries).
"""

from __future__ import annotations

import os

import pytest

from transport.mooncake.link import INSTALL_HINT, TransportUnavailable, engine_class


def mooncake_importable() -> bool:
    try:
        engine_class()
    except TransportUnavailable:
        return False
    return True


def check_mooncake() -> None:
    """Fail a Mooncake test with the install hint where the transport cannot run (or skip it under
    ``NETOPTIM_SKIP_MOONCAKE=1``); called for tests marked ``mooncake`` (tests/conftest.py)."""
    if mooncake_importable():
        return
    if os.environ.get("NETOPTIM_SKIP_MOONCAKE") == "1":
        pytest.skip(f"NETOPTIM_SKIP_MOONCAKE=1: {INSTALL_HINT}")
    pytest.fail(f"{INSTALL_HINT} (or set NETOPTIM_SKIP_MOONCAKE=1 to skip these tests on purpose)")


requires_mooncake = pytest.mark.mooncake
