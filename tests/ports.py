"""Addresses for nodes a test stops and starts again on the same address.

A node started on port 0 gets a port from the kernel's ephemeral range. Once it dies, any other
test's node started on port 0 meanwhile may be given that same port, and the first test's workers,
reconnecting to the address, then register their job with the wrong node (it refuses the second
job: ``LAYOUT_MISMATCH``; seen once in a full run). A port below the ephemeral range is never given
to a port-0 bind, so it stays free for the node's restart."""

from __future__ import annotations

import random
import socket

FALLBACK_RANGE = (32768, 60999)  # Linux's default ephemeral range


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for port-0 binds (``net.ipv4.ip_local_port_range``)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            low, high = (int(word) for word in handle.read().split())
        return low, high
    except (OSError, ValueError):
        return FALLBACK_RANGE


def restartable_address(tries: int = 200) -> str:
    """``tcp://127.0.0.1:PORT`` with a port free now and outside the ephemeral range, for a node
    that will be started again on its address."""
    low, _high = ephemeral_ports()
    candidates = range(max(1024, low - 12000), low)
    for port in random.sample(candidates, min(tries, len(candidates))):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return f"tcp://127.0.0.1:{port}"
    raise RuntimeError(f"no free port below the ephemeral range ({low}) after {tries} tries")
