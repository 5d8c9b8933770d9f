"""``free_port``: a rendezvous port no socket bound to port 0 can take before the rendezvous binds it."""

from __future__ import annotations

import socket

from netoptim.launch.processes import LOWEST_PICKED_PORT, _ephemeral_low, free_port


def test_the_port_is_free_and_below_the_kernels_ephemeral_range():
    low = _ephemeral_low()
    for _ in range(20):
        port = free_port()
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))  # free: the rendezvous can bind it
        if low is not None and low - LOWEST_PICKED_PORT >= 1000:
            assert LOWEST_PICKED_PORT <= port < low, f"{port} is in the range ports bound to 0 are taken from ({low} and up)"


def test_the_range_is_read_from_the_kernels_setting(tmp_path):
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("32768\t60999\n")
    assert _ephemeral_low(setting) == 32768
    setting.write_text("garbage")
    assert _ephemeral_low(setting) is None
    assert _ephemeral_low(tmp_path / "missing") is None
