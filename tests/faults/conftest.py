"""Fixtures shared by the fault drills."""

from __future__ import annotations

import pytest

from tests.faults.harness import References


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> References:
    """Final parameters of uninterrupted runs, per mode (``reference["full"]``), each run once per session."""
    return References(tmp_path_factory.mktemp)
