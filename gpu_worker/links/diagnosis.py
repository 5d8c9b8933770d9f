"""What a worker says when a wait times out: it asks each node what the node itself waits for."""

from __future__ import annotations

import time
from collections.abc import Sequence

from transport.interface import ClientEndpoint
from transport.wire import Header, MsgType


def ask_what_nodes_wait_for(clients: Sequence[ClientEndpoint], rank: int, answer_s: float) -> list[str]:
    """One account per node, in node order: what it waits for (missing ranks, a pause, a failing
    storage, rank 0's initial values or norm), or that it did not answer within ``answer_s``."""
    accounts = []
    for client in clients:
        client.send(Header(msg_type=MsgType.QUERY, rank=rank))
        deadline = time.monotonic() + answer_s
        status = None
        while status is None and time.monotonic() < deadline:
            message = client.recv(max(deadline - time.monotonic(), 0.0))
            if message is not None and message.header.msg_type == MsgType.STATUS:
                status = message.header.meta
        accounts.append(_account(status))
    return accounts


def _account(status: dict | None) -> str:
    if status is None:
        return "no answer (is it running?)"
    if status.get("rank_registered") is False:  # the node tells a connection that is not a registered rank nothing more
        if not status.get("registered"):
            return "it has no job: rank 0 has not registered one there (was the node restarted without --resume?)"
        return "this connection is not registered there as this rank (the node restarted, or another process took the rank)"
    if status.get("paused"):
        return f"updates paused by its operator ({status['paused']})"
    if status.get("storage_error"):
        return f"its state storage fails: {status['storage_error']}"
    missing_ranks = sorted({rank for _bucket, _step, ranks in status["missing"] for rank in ranks})
    if missing_ranks:
        return f"waiting for gradients from rank(s) {missing_ranks} on {len(status['missing'])} bucket(s)"
    if status.get("uninitialized"):
        return f"{len(status['uninitialized'])} bucket(s) have no initial values: rank 0 never registered them"
    if status.get("awaiting_clip") is not None:
        return "waiting for rank 0 to send the global gradient norm"
    return f"waiting for nothing (connected ranks {status['connected_ranks']})"
