"""Moving headers and tensor frames between workers and optimizer nodes.

``transport.wire`` owns the format, ``transport.interface`` the backend contract, and each backend
module one implementation. :func:`create_transport` picks a backend from an address's scheme.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transport.interface import ClientEndpoint, Message, SendHandle, ServerEndpoint, Transport
    from transport.wire import ErrorCode, Header, MsgType, WireError

# The names below load their modules (and torch) on first use: checking an address, as ``netoptim
# node``'s flags do, must not import torch, whose OpenMP runtime reads its settings once, at load
# (netoptim/launch/thread_wait.py).
_LAZY = {
    "ClientEndpoint": "transport.interface",
    "Message": "transport.interface",
    "SendHandle": "transport.interface",
    "ServerEndpoint": "transport.interface",
    "Transport": "transport.interface",
    "ErrorCode": "transport.wire",
    "Header": "transport.wire",
    "MsgType": "transport.wire",
    "WireError": "transport.wire",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'transport' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups find it without this hook
    return value


_SCHEMES = {"tcp": "zmq", "ipc": "zmq", "mooncake": "mooncake", "mooncake+rdma": "mooncake"}


def backend_for(url: str) -> str:
    """The backend name that serves ``url``; ``ValueError`` for an unsupported scheme."""
    scheme, sep, rest = url.partition("://")
    if not sep or not rest:
        raise ValueError(f"address {url!r} needs a scheme, like tcp://127.0.0.1:5555, ipc:///tmp/node.sock or mooncake://10.0.0.11:5555")
    if scheme not in _SCHEMES:
        raise ValueError(f"address {url!r}: unsupported scheme {scheme!r}; supported: {sorted(_SCHEMES)}")
    return _SCHEMES[scheme]


def create_transport(url: str, **options: object) -> Transport:
    """A transport able to bind or connect to ``url``.

    ``options`` are the keyword arguments of the backend ``url``'s scheme picks, passed on unchanged,
    so that a caller can set what only one backend has:

    - ``tcp://`` and ``ipc://``: :class:`transport.zeromq.backend.ZmqTransport` (``max_message_bytes``,
      ``chunk_bytes``, ``io_threads``, ``curve_server``, ``curve_client``, ``connections_per_peer``,
      ``max_frame_bytes``, ``max_header_bytes``, ``max_peers``, ``same_host_window_bytes``, ...);
    - ``mooncake://`` and ``mooncake+rdma://``: :class:`transport.mooncake.backend.MooncakeTransport`
      (``max_message_bytes``, ``chunk_bytes``, ``window_bytes``, ``curve_server``/``curve_client``
      (refused: CURVE is the ZeroMQ backend's), ``connections_per_peer`` (1 only), ``io_threads``).

    A keyword the backend does not take raises ``TypeError``; ``ValueError`` for an unsupported scheme.
    """
    backend = backend_for(url)
    if backend == "zmq":
        from transport.zeromq.backend import ZmqTransport

        return ZmqTransport(**options)  # type: ignore[arg-type]
    if backend == "mooncake":
        from transport.mooncake.backend import MooncakeTransport

        return MooncakeTransport(**options)  # type: ignore[arg-type]
    raise AssertionError(f"no backend module for {backend}")


__all__ = [
    "ClientEndpoint",
    "ErrorCode",
    "Header",
    "Message",
    "MsgType",
    "SendHandle",
    "ServerEndpoint",
    "Transport",
    "WireError",
    "backend_for",
    "create_transport",
]
