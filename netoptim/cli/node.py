"""``netoptim node``: running the daemon with its admin and metrics servers until SIGTERM or SIGINT.
Its flags are defined in :mod:`netoptim.cli.node_parser` and become its configs in
:mod:`netoptim.cli.node_configs`; :mod:`netoptim.cli.node_start` starts the parts."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading

from netoptim.cli.node_configs import admin_config_from_args, node_config_from_args
from netoptim.cli.node_start import NodeStartError, bind_servers, start_daemon
from netoptim.launch.host_cpus import CpuPlacement, format_cpu_list, run_on, usable_cpus
from netoptim.launch.huge_pages import apply_huge_pages
from netoptim.launch.niceness import apply_niceness
from netoptim.launch.thread_wait import apply_update_thread_wait, resolve_update_thread_wait

log = logging.getLogger("netoptim")


def run_node(args: argparse.Namespace) -> int:
    """``netoptim node``: exit 0 after a clean stop, 2 for invalid flags, 1 when the node cannot start
    (an address in use, a missing ``--resume`` directory, an unreadable checkpoint)."""
    if getattr(args, "print_config", False):
        from netoptim.job.config_file import ConfigSources, describe

        print(describe(args, args.node_parser, getattr(args, "config_sources", None) or ConfigSources(), secret_dests=frozenset({"admin_token"})))
        return 0
    placement = CpuPlacement(cpus=args.cpus, numa_node=args.numa_node)
    try:
        cpus = placement.resolve()
        apply_niceness(args.nice)  # before the node starts its threads, which inherit it
    except (ValueError, PermissionError) as exc:
        log.error("invalid node configuration: %s", exc)
        return 2
    # Out of core, the store's reader and writer threads run on the node's CPUs beside the update threads.
    wanted = resolve_update_thread_wait(args.update_threads_wait, own_cpus=cpus is not None and not args.state_dir)
    wait = wanted if apply_update_thread_wait(wanted) else "as OpenMP was loaded"  # before torch loads OpenMP
    if wait != wanted:
        log.log(
            logging.INFO if args.update_threads_wait == "auto" else logging.WARNING,
            "this process loaded OpenMP before the node started: its update threads keep the wait policy it loaded with, not %r",
            wanted,
        )
    huge_pages = apply_huge_pages(args.huge_pages)  # before torch's first large allocation
    import torch

    from optimizer_node.faults import CrashPoints

    config = node_config_from_args(args)
    try:
        config.validate()
        CrashPoints(config.crash_at)  # validates the spelling before anything starts
        admin_config = admin_config_from_args(args)
    except ValueError as exc:
        log.error("invalid node configuration: %s", exc)
        return 2
    except OSError as exc:  # --resume with a checkpoint directory that is not there
        log.error("cannot resume: %s: %s; check --checkpoint-dir, or leave out --resume to start fresh", exc.strerror, exc.filename)
        return 1
    if cpus is not None:  # before the daemon starts its threads and first writes its state
        run_on(cpus, args.threads, pass_thread=args.pass_thread, store_io_threads=config.store_io_threads)
    elif args.threads:
        torch.set_num_threads(args.threads)
    log.info(
        "node config: %s (niceness: %d; torch threads: %d; CPUs: %s; update threads between passes: %s; huge pages: %s)",
        dataclasses.asdict(config),
        args.nice,
        torch.get_num_threads(),
        format_cpu_list(cpus) if cpus is not None else f"any of {format_cpu_list(usable_cpus())}",
        wait,
        huge_pages,
    )
    if config.state_at_risk:  # once, where an operator reads the start; also in status and netoptim_state_at_risk
        log.warning("%s", config.state_at_risk)
    try:
        servers = bind_servers(args, admin_config)
    except NodeStartError as exc:
        log.error("%s", exc)
        return 1
    try:
        daemon = start_daemon(config)
    except NodeStartError as exc:
        log.error("%s", exc)
        servers.stop()
        return 1
    servers.start(daemon)
    stop = threading.Event()
    received: list[int] = []

    def request_stop(signum: int, _frame: object) -> None:
        # Nothing is logged here: the handler runs between two bytecodes of the main thread, which may
        # be inside a write to the log's stream, and a second write into it raises ("reentrant call").
        received.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        daemon.serve(stop)
    finally:
        if received:
            log.info("stopped on %s", signal.Signals(received[0]).name)
        servers.stop()
    return 0
