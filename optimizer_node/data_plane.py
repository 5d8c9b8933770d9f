"""A node's data plane, bound once at its start: the transport and its server endpoint on
``--listen``, encrypted with CURVE when the config names the node's secret key and the allowed
workers' keys, and the allow list of which ranks each allowed key may register as."""

from __future__ import annotations

from typing import NamedTuple

from optimizer_node.config import NodeConfig
from optimizer_node.registration import load_allow_list
from transport import create_transport
from transport.interface import ServerEndpoint, Transport
from transport.security import AllowList, CurveServerConfig


class DataPlane(NamedTuple):
    """What :func:`bind_data_plane` bound, and the allow list (``None`` without CURVE)."""

    transport: Transport
    endpoint: ServerEndpoint
    allow_list: AllowList | None


def bind_data_plane(config: NodeConfig) -> DataPlane:
    """Bind ``config.listen``; a bad allow-list file releases what was bound and raises."""
    curve = CurveServerConfig(config.curve_secret_key, config.curve_allow) if config.curve_secret_key and config.curve_allow else None
    transport = create_transport(
        config.listen,
        max_message_bytes=config.max_message_bytes,
        chunk_bytes=config.chunk_bytes,
        curve_server=curve,
        io_threads=config.io_threads,
        **config.endpoint_limits(),
    )
    endpoint = transport.bind(config.listen)
    try:  # which ranks each allowed key may register as; a bad allow-list file stops the start
        allow_list = load_allow_list(curve.allowed_keys_dir) if curve is not None else None
    except Exception:
        endpoint.close()
        transport.close()
        raise
    return DataPlane(transport, endpoint, allow_list)
