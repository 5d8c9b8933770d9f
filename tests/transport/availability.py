"""Whether the optional Mooncake transport can run here (CI installs it: netoptim[rdma] + system libraries)."""

from __future__ import annotations

import pytest

from transport.mooncake_link import INSTALL_HINT, TransportUnavailable, engine_class


def mooncake_importable() -> bool:
    try:
        engine_class()
    except TransportUnavailable:
        return False
    return True


requires_mooncake = pytest.mark.skipif(not mooncake_importable(), reason=INSTALL_HINT)
