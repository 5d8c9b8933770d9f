"""What a ZeroMQ client's connection did, from the socket's monitor events: whether it dropped since
last asked, and, when the node does not answer, why in words (nothing listens at the address, the
CURVE handshake failed, the host never answered) instead of a silent timeout.

ZeroMQ connects and reconnects by itself and tells nothing of it through the socket; its monitor
socket reports each attempt. A refused connection shows as ``CONNECT_RETRIED`` with no ``CONNECTED``
before it; a node with other CURVE keys as ``CONNECTED`` then ``HANDSHAKE_FAILED_*``; a host that
drops the packets as neither, until the kernel gives up on the attempt.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq

WATCHED_EVENTS = (
    zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
"""The monitor events a client subscribes to."""

_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
"""Which of these a failed handshake shows varies with timing (a client without CURVE at a CURVE node
saw PROTOCOL or NO_DETAIL), so they are told apart by what this side knows: whether it uses CURVE."""


@dataclass(slots=True)
class LinkWatch:
    """A client connection's history as its monitor events tell it (:meth:`see` each one)."""

    dropped: bool = False  # a DISCONNECTED since :meth:`take_dropped`
    handshakes: int = 0  # sessions that got through the handshake (security included)
    refused: int = 0  # attempts that failed since the last good handshake (refused, no such socket, host unreachable)
    failed_handshake: bool = False  # the last handshake failed (none succeeded since)
    curve: bool = False  # this side uses CURVE: which way a failed handshake points

    def see(self, event: int) -> None:
        """Take one monitor event."""
        if event == zmq.EVENT_DISCONNECTED:
            self.dropped = True
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.handshakes += 1
            self.refused = 0
            self.failed_handshake = False
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self.refused += 1
        elif event & _HANDSHAKE_FAILED:
            self.failed_handshake = True

    def take_dropped(self) -> bool:
        """Whether the connection dropped since the last call."""
        dropped, self.dropped = self.dropped, False
        return dropped

    def problem(self) -> str | None:
        """What keeps this connection from carrying messages, where the events say for certain; else ``None``."""
        if self.failed_handshake and not self.curve:
            return (
                "the connection is made but its handshake fails: the node uses CURVE and this worker does not (give it "
                "curve_secret_key and curve_server_key), or what listens there is not a netoptim node"
            )
        if self.failed_handshake:
            return (
                "the connection is made but the CURVE handshake fails: the worker's curve_server_key is not the node's "
                "public key, the node's --curve-allow directory lacks this worker's key, or the node does not use CURVE"
            )
        if self.refused and not self.handshakes:
            return (
                f"no connection: {self.refused} attempt(s) refused or unreachable, nothing accepts connections at that address "
                "(a wrong host or port, or the node is not started yet)"
            )
        if self.refused:
            return f"the connection dropped and every attempt since failed ({self.refused}): the node is gone from that address"
        return None

    def describe(self) -> str:
        """The connection's state in words, for an error that says the node did not answer."""
        problem = self.problem()
        if problem is not None:
            return problem
        if self.handshakes:
            return "connected, but nothing came back (is it a netoptim node, and not stopped or stuck?)"
        return "no connection yet: the host has not answered the attempt (a wrong host, or a firewall that drops the packets?)"
