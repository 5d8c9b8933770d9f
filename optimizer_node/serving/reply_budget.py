"""What a node may hold of its answers to peers outside the job: a peer that sends requests and never
reads the answers must not grow the node's send queue.

The job's ranks read everything the node sends them (the protocol bounds what a rank has outstanding),
so their answers are not counted. Every other peer (not registered, or not yet) gets only small answers
(``ERROR``, ``STATUS``, a welcome; ECHO has its own bound), sent with every frame tracked, so the node
knows which of them still wait in its queue. While a peer has ``per_peer_bytes`` of answers waiting, or
all such peers together ``total_bytes``, further answers to it are dropped (and counted): the peer does
not read them anyway, and a peer that does read never comes near the bound.
"""

from __future__ import annotations

from collections import deque

from transport.interface import SendHandle

PER_PEER_SHARE = 16
"""A peer may hold 1/16 of the total: a few peers that do not read leave room for the rest."""


class UnregisteredReplyBudget:
    """Bytes of answers to peers outside the job that have not left the node yet."""

    def __init__(self, total_bytes: int) -> None:
        if not isinstance(total_bytes, int) or total_bytes < 1:
            raise ValueError(f"the budget of unread answers must be a positive number of bytes, got {total_bytes!r}")
        self.total_bytes = total_bytes
        self.per_peer_bytes = max(total_bytes // PER_PEER_SHARE, 1)
        self._waiting: dict[bytes, deque[tuple[SendHandle, int]]] = {}
        self._peer_bytes: dict[bytes, int] = {}
        self.held_bytes = 0
        self.dropped = 0

    def admits(self, peer: bytes, nbytes: int) -> bool:
        """Whether an answer of ``nbytes`` to ``peer`` may be queued now; ``False`` counts it as dropped."""
        self._settle(peer)
        if self.held_bytes + nbytes > self.total_bytes:
            self._settle_all()  # other peers' answers may have left meanwhile
        if self._peer_bytes.get(peer, 0) + nbytes > self.per_peer_bytes or self.held_bytes + nbytes > self.total_bytes:
            self.dropped += 1
            return False
        return True

    def queued(self, peer: bytes, handle: SendHandle, nbytes: int) -> None:
        """An answer of ``nbytes`` went into the queue; ``handle`` is done once all its frames left."""
        if handle.done():
            return
        self._waiting.setdefault(peer, deque()).append((handle, nbytes))
        self._peer_bytes[peer] = self._peer_bytes.get(peer, 0) + nbytes
        self.held_bytes += nbytes

    def _settle(self, peer: bytes) -> None:
        waiting = self._waiting.get(peer)
        if not waiting:
            return
        freed = 0
        while waiting and waiting[0][0].done():  # answers leave a peer's queue in order
            freed += waiting.popleft()[1]
        self.held_bytes -= freed
        if waiting:
            self._peer_bytes[peer] -= freed
        else:
            del self._waiting[peer]
            del self._peer_bytes[peer]

    def _settle_all(self) -> None:
        for peer in list(self._waiting):
            self._settle(peer)
