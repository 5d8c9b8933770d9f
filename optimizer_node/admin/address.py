"""The admin service's address: ``HOST:PORT`` checked, and why gRPC could not bind it (it says only
that it failed).
"""

from __future__ import annotations

import errno
import socket


def split_host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` as ``(host, port)``, the host as written (``[::1]`` keeps its brackets); ``ValueError``
    unless the port is a number from 0 (the OS picks) to 65535: gRPC would wrap 99999 to 34463."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"admin address {address!r} must be HOST:PORT, like 127.0.0.1:7000 (port 0: the OS picks)")
    if int(port) > 65535:
        raise ValueError(f"admin address {address!r}: port {int(port)} is out of range (0 to 65535; 0 lets the OS choose)")
    return host, int(port)


def _port_taken(host: str, port: int) -> bool:
    """Whether another socket listens on ``host:port``: a plain bind with SO_REUSEADDR (as gRPC's own)
    fails with EADDRINUSE exactly then on Linux."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False
    for family, kind, proto, _name, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


def bind_error(address: str, detail: str) -> OSError:
    """Why gRPC could not bind ``address`` (it says only that it failed), as an ``OSError`` whose
    ``filename`` is the address and whose ``errno`` is ``EADDRINUSE`` when another process holds it."""
    host, port = split_host_port(address)
    if port and _port_taken(host, port):
        return OSError(errno.EADDRINUSE, "in use by another process", address)
    return OSError(errno.EADDRNOTAVAIL, f"gRPC cannot bind it ({detail}); is the host an address of this machine?", address)
