"""Flags every node the test fixtures and the fault harness start gets besides the test's own: the
suite run again with, say, ``NETOPTIM_TEST_NODE_ARGS=--pass-thread`` checks that mode against every
test's expectations."""

from __future__ import annotations

import os

NODE_ARGS: tuple[str, ...] = tuple(os.environ.get("NETOPTIM_TEST_NODE_ARGS", "").split())
