"""Starting a node's parts in order: the admin and metrics servers bound first (a taken port stops the
node before it clears a state directory or loads a checkpoint), then the daemon built, then the
servers started on it; :class:`NodeStartError` says what could not start and what to do."""

from __future__ import annotations

import argparse
import dataclasses
import errno
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from optimizer_node import NodeConfig, NodeDaemon
    from optimizer_node.admin.service import AdminConfig, AdminServer
    from optimizer_node.metrics import MetricsServer


class NodeStartError(Exception):
    """The node cannot start; the message says why and what to do."""


def bind_error(what: str, address: str, flag: str, exc: BaseException) -> str:
    """The message for a server that could not bind ``address``; for one another process holds, it
    names the address and says what to do."""
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return f"cannot start the node: {what} address {exc.filename or address} is in use by another process: pick another {flag} or stop the other node"
    detail = f"{exc.strerror} ({exc.filename})" if isinstance(exc, OSError) and exc.strerror and exc.filename else str(exc)
    return f"cannot start the node: cannot serve {what} on {address}: {detail}"


@dataclasses.dataclass(slots=True)
class NodeServers:
    """The admin and metrics servers of a node: bound before the daemon is built (so a taken port
    stops a node before it clears a state directory or loads a checkpoint), started after."""

    admin: AdminServer | None = None
    metrics: MetricsServer | None = None

    def start(self, daemon: NodeDaemon) -> None:
        """Serve ``daemon`` on the bound addresses; they go into its ready file."""
        if self.admin is not None:
            self.admin.start(daemon.admin_handle())
            daemon.admin_address = self.admin.address
        if self.metrics is not None:
            self.metrics.start(daemon.metrics)
            daemon.metrics_address = self.metrics.address

    def stop(self) -> None:
        """Stop both and release their addresses."""
        if self.admin is not None:
            self.admin.stop()
        if self.metrics is not None:
            self.metrics.stop()


def bind_servers(args: argparse.Namespace, admin_config: AdminConfig | None) -> NodeServers:
    """Bind the admin and metrics addresses that ``args`` asks for; :class:`NodeStartError` when one
    cannot be bound (what was bound is released)."""
    servers = NodeServers()
    if admin_config is not None:
        from optimizer_node.admin.service import AdminServer

        try:
            servers.admin = AdminServer(admin_config)
        except (OSError, ValueError) as exc:
            raise NodeStartError(bind_error("admin", admin_config.address, "--admin port", exc)) from exc
    if args.metrics_port is not None:
        from optimizer_node.metrics import MetricsServer

        address = f"{args.metrics_host}:{args.metrics_port}"
        try:
            servers.metrics = MetricsServer(args.metrics_host, args.metrics_port)
        except (OSError, ValueError) as exc:
            servers.stop()
            raise NodeStartError(bind_error("metrics", address, "--metrics-port", exc)) from exc
    return servers


def start_daemon(config: NodeConfig) -> NodeDaemon:
    """Build the daemon (it binds the data plane, prepares its store and loads a checkpoint on
    ``resume``); :class:`NodeStartError` when it cannot start."""
    from optimizer_node import NodeDaemon

    try:
        return NodeDaemon(config)
    except Exception as exc:  # a port in use, a bad address, an unreadable checkpoint: say so and exit non-zero
        if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
            flag = "--listen path" if config.listen.startswith("ipc://") else "--listen port"
            raise NodeStartError(bind_error("data", config.listen, flag, exc)) from exc
        raise NodeStartError(f"cannot start the node on {config.listen}: {exc}") from exc
