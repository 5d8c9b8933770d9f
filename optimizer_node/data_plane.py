"""A node's data plane, bound once at its start: the transport and its server endpoint on
``--listen``, encrypted with CURVE when the config names the node's secret key and the allowed
workers' keys, and the allow list of which ranks each allowed key may register as."""

from __future__ import annotations

import logging
from typing import NamedTuple

from optimizer_node.config import NodeConfig
from optimizer_node.intake.registration import load_allow_list
from optimizer_node.log_limits import RateLimitedLog
from transport import create_transport
from transport.interface import ServerEndpoint, Transport
from transport.zeromq.security import AllowList, CurveServerConfig

log = logging.getLogger(__name__)


class KeyRefusals:
    """Says in the node's log that a connection's CURVE key is not allowed, at most once per
    interval (a stranger may knock many times a second), with the count of those not said."""

    def __init__(self, allowed_dir: str) -> None:
        self._allowed_dir = allowed_dir
        self._log = RateLimitedLog(log)
        self.count = 0  # written on the ZAP handler's thread, read at metrics scrapes: a plain int

    def say(self, key: str) -> None:
        self.count += 1
        self._log.log(
            "curve-refused",
            logging.WARNING,
            "refused a data-plane connection: its CURVE public key %s is not in --curve-allow %s (a worker that should train "
            "needs its .key file there, and the node restarted)",
            key,
            self._allowed_dir,
        )


class DataPlane(NamedTuple):
    """What :func:`bind_data_plane` bound, the allow list and the refused keys' count (``None`` without CURVE)."""

    transport: Transport
    endpoint: ServerEndpoint
    allow_list: AllowList | None
    key_refusals: KeyRefusals | None


def bind_data_plane(config: NodeConfig) -> DataPlane:
    """Bind ``config.listen``; a bad allow-list file raises before anything is bound."""
    curve = CurveServerConfig(config.curve_secret_key, config.curve_allow) if config.curve_secret_key and config.curve_allow else None
    options: dict[str, object] = {}
    allow_list: AllowList | None = None
    refusals: KeyRefusals | None = None
    if curve is not None:
        curve.validate()  # a missing directory said as such, before its (absent) files are read
        # which ranks each allowed key may register as, read once: the handshake lets in the same keys
        allow_list = load_allow_list(curve.allowed_keys_dir)
        refusals = KeyRefusals(curve.allowed_keys_dir)
        options = {"curve_server": curve, "allowed_keys": allow_list.public_keys, "on_key_refused": refusals.say}
    transport = create_transport(
        config.listen,
        max_message_bytes=config.max_message_bytes,
        chunk_bytes=config.chunk_bytes,
        io_threads=config.io_threads,
        **options,
        **config.endpoint_limits(),
    )
    try:
        endpoint = transport.bind(config.listen)
    except BaseException:
        transport.close()
        raise
    return DataPlane(transport, endpoint, allow_list, refusals)
