"""Flags every node the test fixtures and the fault harness start gets besides the test's own: the
suite run again with, say, ``NETOPTIM_TEST_NODE_ARGS=--pass-thread`` checks that mode against every
test's expectations."""

from __future__ import annotations

import os

NODE_ARGS: tuple[str, ...] = tuple(os.environ.get("NETOPTIM_TEST_NODE_ARGS", "").split())

EXCLUDES = {"--pass-thread": "--state-dir"}
"""A flag a node refuses beside one of the test's own (the passes' thread is for nodes in memory)."""


def with_node_args(own: tuple[str, ...]) -> tuple[str, ...]:
    """A test's node flags and :data:`NODE_ARGS`, less those the test's own rule out."""
    return (*own, *(flag for flag in NODE_ARGS if EXCLUDES.get(flag) not in own))
