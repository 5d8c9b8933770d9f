"""Whether an address a server binds is reachable from other hosts.

A node whose data plane is reachable from the network without CURVE lets anyone who reaches the port
register as a rank, read every bucket and push gradients; the node refuses to start that way unless
told ``--insecure`` (see :meth:`optimizer_node.config.NodeConfig.validate`).
"""

from __future__ import annotations

import ipaddress
import socket

LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def _host_is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host in ("", "*"):
        return False  # every interface
    if host.lower() in LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    # A host or interface name: loopback only if every address it stands for is.
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False  # unresolvable here: ZeroMQ may still take it as an interface name
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def reachable_from_network(url: str) -> bool:
    """True unless ``url`` binds only loopback (``tcp://127.0.0.1:P``, ``tcp://[::1]:P``,
    ``tcp://localhost:P``) or a Unix socket (``ipc://``, guarded by file permissions)."""
    scheme, _, rest = url.partition("://")
    if scheme == "ipc":
        return False
    host, _, _port = rest.rpartition(":")
    if host.startswith("lo:") or host == "lo":  # ZeroMQ interface-name syntax
        return False
    return not _host_is_loopback(host)
