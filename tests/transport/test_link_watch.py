"""What a client's monitor events say of its connection (:class:`transport.zeromq.link_watch.LinkWatch`);
the same texts on real sockets are in ``test_curve.py`` and ``test_remote_adamw.py``."""

from __future__ import annotations

import zmq

from transport.zeromq.link_watch import LinkWatch


def watched(*events: int, curve: bool = False) -> LinkWatch:
    link = LinkWatch(curve=curve)
    for event in events:
        link.see(event)
    return link


def test_refused_attempts_before_any_connection_mean_nothing_listens():
    link = watched(zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_CONNECT_RETRIED)
    assert link.problem() is not None and "2 attempt(s) refused or unreachable, nothing accepts connections at that address" in link.problem()
    assert link.describe() == link.problem()


def test_a_failed_handshake_names_the_keys_or_curve_missing_here_by_what_this_side_uses():
    for failed in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
        assert "CURVE handshake fails: the worker's curve_server_key" in watched(zmq.EVENT_CONNECTED, failed, curve=True).problem()
        assert "the node uses CURVE and this worker does not" in watched(zmq.EVENT_CONNECTED, failed).problem()


def test_a_good_handshake_clears_what_went_before_and_a_silent_node_is_no_certain_problem():
    link = watched(zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    assert link.problem() is None and link.describe().startswith("connected, but nothing came back")
    assert LinkWatch().problem() is None and LinkWatch().describe().startswith("no connection yet")


def test_a_node_gone_from_its_address_after_a_session_is_told_apart_from_one_never_there():
    link = watched(zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_CONNECT_RETRIED)
    assert "the node is gone from that address" in link.problem()
    assert link.take_dropped() is True and link.take_dropped() is False  # each drop is told once


def test_events_left_undrained_never_stop_the_sockets_io():
    """ZeroMQ's I/O thread blocks on a full monitor queue: a client's monitor has no high-water mark,
    so a node that refused connections for thousands of attempts, unasked, still gets what comes after."""
    import socket as sockets
    import time

    from transport.zeromq.backend import _monitor_of

    probe = sockets.socket()
    probe.bind(("127.0.0.1", 0))  # a free loopback port, closed again: nothing listens there yet
    port = probe.getsockname()[1]
    probe.close()
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RECONNECT_IVL, 1)
        dealer.setsockopt(zmq.LINGER, 0)
        monitor = _monitor_of(dealer, context)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not monitor.poll(0):
            time.sleep(0.01)
        time.sleep(4)  # thousands of refused attempts, none of their events read (a bounded queue holds 2,000)
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(f"tcp://127.0.0.1:{port}")
        dealer.send(b"after the refusals")
        assert router.poll(5000), "the client's I/O stopped behind its monitor's queue"
        assert router.recv_multipart()[1] == b"after the refusals"
        events = 0
        while monitor.poll(0):
            monitor.recv_multipart()
            events += 1
        assert events > 2000, f"only {events} events: the case a bounded queue blocks on was not reached"
    finally:
        context.destroy(linger=0)
