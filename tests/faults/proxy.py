"""A userspace TCP forwarder on 127.0.0.1 that puts link faults between workers and a node.

``LinkProxy(("127.0.0.1", node_port)).start()`` listens on an OS-chosen port of 127.0.0.1 and
forwards every connection it accepts to the node. TCP never loses bytes, so the faults it can emulate
are those a worker sees on a real network:

- ``delay_s``: each chunk is forwarded ``delay_s`` after it arrived, in each direction (latency, not a
  bandwidth limit: chunks behind it are not held longer);
- ``partition(seconds)``: nothing is forwarded either way, and new connections get no bytes, for that
  long; what arrived meanwhile is delivered afterwards (a link that came back, TCP retransmitting);
- ``reset_all()`` / ``reset_probability``: connections are closed with an RST (SO_LINGER 0), now or
  after a forwarded chunk with that probability (drawn from the seeded ``rng``): bytes still in flight
  are lost, the way a lossy link that gives up or a middlebox that drops a flow loses them.

``bytes_up`` / ``bytes_down`` count bytes forwarded to and from the node, so a test can check that
the traffic really crossed the proxy.
"""

from __future__ import annotations

import collections
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

CHUNK_BYTES = 64 << 10


@dataclass
class _Pipe:
    """One direction of one connection: a reader thread queues chunks, a writer thread sends them when due."""

    source: socket.socket
    sink: socket.socket
    queue: collections.deque = field(default_factory=collections.deque)
    ready: threading.Condition = field(default_factory=threading.Condition)
    closed: bool = False


class LinkProxy:
    """A TCP forwarder to ``target`` with settable delay, partitions and connection resets."""

    def __init__(self, target: tuple[str, int], *, delay_s: float = 0.0, reset_probability: float = 0.0, seed: int | str = 0) -> None:
        assert target[0] == "127.0.0.1", "the fault tests stay on the loopback interface"
        self.target = target
        self.delay_s = delay_s
        self.reset_probability = reset_probability
        self.rng = random.Random(seed)
        self.bytes_up = 0  # to the node
        self.bytes_down = 0  # from the node
        self.connections = 0
        self.resets = 0
        self._lock = threading.Lock()
        self._paused_until = 0.0
        self._links: list[tuple[socket.socket, socket.socket]] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._stopped = False

    @property
    def address(self) -> str:
        """The address workers are given instead of the node's."""
        return f"tcp://127.0.0.1:{self.port}"

    def start(self) -> LinkProxy:
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()
        return self

    def partition(self, seconds: float) -> None:
        """Stop forwarding, in both directions and on every connection, for ``seconds`` from now."""
        with self._lock:
            self._paused_until = time.monotonic() + seconds

    def reset_all(self) -> int:
        """Close every open connection with an RST (both sides); returns how many were reset."""
        with self._lock:
            links, self._links = self._links, []
        for pair in links:
            self._reset(pair)
        return len(links)

    def close(self) -> None:
        self._stopped = True
        self._listener.close()
        self.reset_all()

    def __enter__(self) -> LinkProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5.0)
            except OSError:  # the node is down (restarting): the worker's connection fails as it would
                self._abort(client)
                continue
            upstream.settimeout(None)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = (client, upstream)
            with self._lock:
                self._links.append(pair)
                self.connections += 1
            for source, sink, up in ((client, upstream, True), (upstream, client, False)):
                pipe = _Pipe(source, sink)
                threading.Thread(target=self._read, args=(pipe, pair), daemon=True).start()
                threading.Thread(target=self._write, args=(pipe, pair, up), daemon=True).start()

    def _read(self, pipe: _Pipe, pair: tuple[socket.socket, socket.socket]) -> None:
        while True:
            try:
                data = pipe.source.recv(CHUNK_BYTES)
            except OSError:
                data = b""
            with pipe.ready:
                if not data:
                    pipe.closed = True
                else:
                    pipe.queue.append((time.monotonic() + self.delay_s, data))
                pipe.ready.notify()
            if not data:
                return

    def _write(self, pipe: _Pipe, pair: tuple[socket.socket, socket.socket], up: bool) -> None:
        while True:
            with pipe.ready:
                while not pipe.queue and not pipe.closed:
                    pipe.ready.wait()
                if not pipe.queue:  # the source closed and everything was forwarded
                    self._drop(pair)
                    return
                due, data = pipe.queue[0]
            wait = max(due, self._paused_until) - time.monotonic()
            if wait > 0:
                time.sleep(min(wait, 0.05))
                continue
            with pipe.ready:
                pipe.queue.popleft()
            try:
                pipe.sink.sendall(data)
            except OSError:
                self._drop(pair)
                return
            with self._lock:
                if up:
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
            if self.reset_probability and self.rng.random() < self.reset_probability:
                self._drop(pair, reset=True)
                return

    def _drop(self, pair: tuple[socket.socket, socket.socket], reset: bool = False) -> None:
        with self._lock:
            if pair not in self._links:
                return
            self._links.remove(pair)
        if reset:
            self._reset(pair)
        else:
            for sock in pair:
                _close(sock)

    def _reset(self, pair: tuple[socket.socket, socket.socket]) -> None:
        with self._lock:
            self.resets += 1
        for sock in pair:
            self._abort(sock)

    @staticmethod
    def _abort(sock: socket.socket) -> None:
        """Close with an RST instead of a FIN: unsent and unacknowledged bytes are dropped."""
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.shutdown(socket.SHUT_RD)  # wakes this socket's reader; sends nothing (SHUT_WR would send a FIN)
        except OSError:
            pass
        sock.close()


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
