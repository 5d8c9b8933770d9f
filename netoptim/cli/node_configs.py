"""The one place where ``netoptim node``'s flags become configs: the node's
:class:`~optimizer_node.NodeConfig`, and the admin service's
:class:`~optimizer_node.admin.service.AdminConfig` with its token. What they configure is imported lazily,
to keep ``--help`` fast."""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING

from netoptim.cli.admin import TOKEN_ENV
from netoptim.cli.node_parser import LIMIT_FLAGS

if TYPE_CHECKING:
    from optimizer_node import NodeConfig
    from optimizer_node.admin.service import AdminConfig

log = logging.getLogger("netoptim")


def node_config_from_args(args: argparse.Namespace) -> NodeConfig:  # NodeConfig imported lazily, to keep --help fast
    """The one place where flags become a :class:`NodeConfig`."""
    from optimizer_node import NodeConfig

    config = NodeConfig(
        listen=args.listen,
        same_host_ipc=args.same_host_ipc,
        same_host_window_mb=args.same_host_window_mb,
        same_host_board=args.same_host_board,
        masters_on_board=args.masters_on_board,
        same_host_gradient_window=args.same_host_gradient_window,
        ready_file=args.ready_file,
        node_id=args.node_id,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep=args.keep,
        resume=args.resume,
        crash_at=args.crash_at,
        curve_secret_key=args.curve_secret_key,
        curve_allow=args.curve_allow,
        insecure=args.insecure,
        state_dir=args.state_dir,
        memory_budget=args.memory_budget,
        sync_state_writes=args.sync_state_writes,
        state_io_threads=args.state_io_threads,
        non_finite=args.non_finite,
        non_finite_check=args.non_finite_check,
        next_job=args.next_job,
        io_threads=args.io_threads,
        pass_thread=args.pass_thread,
    )
    if args.chunk_bytes is not None:
        config.chunk_bytes = args.chunk_bytes
    for name in LIMIT_FLAGS:  # only those given: the rest keep NodeConfig's defaults
        if getattr(args, name) is not None:
            setattr(config, name, getattr(args, name))
    return config


def admin_config_from_args(args: argparse.Namespace) -> AdminConfig | None:
    """The admin service's settings, or ``None`` when ``--admin`` is not given; ``ValueError`` for bad ones."""
    if args.admin is None:
        return None
    from optimizer_node.admin.address import split_host_port
    from optimizer_node.admin.service import AdminConfig
    from transport.exposure import reachable_from_network

    host, _port = split_host_port(args.admin)
    token = admin_token(args)
    if not token and not args.insecure and reachable_from_network(f"tcp://{host}:0"):
        raise ValueError(
            f"--admin {args.admin} is reachable from the network and has no token: anyone who reaches it could pause, reconfigure or stop the node. "
            f"Give --admin-token-file (and --tls-cert/--tls-key), bind it to 127.0.0.1, or pass --insecure on a trusted network"
        )
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    return AdminConfig(address=args.admin, token=token, tls_cert=args.tls_cert, tls_key=args.tls_key)


def admin_token(args: argparse.Namespace) -> str | None:
    """The admin token from --admin-token-file, --admin-token (with a warning: argv is public on a
    host) or the environment; ``ValueError`` for more than one of the flags or an unsafe file."""
    from transport.secret_files import read_token_file

    if args.admin_token_file and args.admin_token:
        raise ValueError("give the admin token once: --admin-token-file or --admin-token")
    if args.admin_token_file:
        return read_token_file(args.admin_token_file)
    if args.admin_token:
        log.warning("--admin-token on the command line is visible to every user of this host (ps); use --admin-token-file or $%s", TOKEN_ENV)
        return args.admin_token
    return os.environ.get(TOKEN_ENV) or None
