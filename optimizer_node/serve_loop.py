"""The node's one thread, from its start to its stop: :class:`ServeLoop`.

Once the node serves it says so, in its log (with a warning where the data plane is reachable from
the network without CURVE) and in the ready file, written atomically so that a reader never sees half
of it. Then each turn of the loop runs the admin calls waiting (between two passes), takes every
message already waiting, and only then applies ready updates, up to ``APPLY_BURST`` in a row: the
lowest bucket id first (:mod:`optimizer_node.update.queue`). With ``--pass-thread`` a ready update is
handed to the pass thread before any message is read, and a pass that ends wakes the wait for
messages (where the endpoint cannot be woken, the loop looks for ended passes every
``PASS_POLL_S``). Once stopped, the passes are settled, the batched values sent, the admin calls
waiting answered and the job's last state checkpointed before the node closes.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from transport.wire import WireError

if TYPE_CHECKING:
    from optimizer_node.config import NodeConfig
    from optimizer_node.control import CommandQueue
    from optimizer_node.serving.outgoing import Outgoing
    from optimizer_node.serving.replies import ParameterReplies
    from optimizer_node.state.storage import BucketStore
    from optimizer_node.update.bucket_apply import PendingUpdate
    from optimizer_node.update.pass_thread import PassThread
    from optimizer_node.update.queue import UpdateQueue
    from transport.interface import Message, ServerEndpoint

log = logging.getLogger(__name__)

APPLY_BURST = 8
"""Ready updates applied in a row before the serve loop looks for messages again."""

PASS_POLL_S = 0.001
"""With passes on their own thread and an endpoint that cannot be woken by it: how often the serve
loop looks for finished passes while it waits for messages."""


class ServedParts(NamedTuple):
    """The job's parts the loop works with at each turn (letting a job go makes new ones)."""

    updates: UpdateQueue
    store: BucketStore
    replies: ParameterReplies


class ServeLoop:
    """Receives each message and has it handled, applies the ready updates, runs the admin service's
    calls.

    ``commands``: those calls; ``passes``: the node's pass thread, ``None`` without ``--pass-thread``;
    ``parts``: the job's parts of the moment; ``handle``: the handling of one message; ``finish``: what
    the node does once the loop stopped (its last state out, its close)."""

    def __init__(
        self,
        config: NodeConfig,
        endpoint: ServerEndpoint,
        outgoing: Outgoing,
        commands: CommandQueue,
        passes: PassThread[PendingUpdate] | None,
        *,
        parts: Callable[[], ServedParts],
        handle: Callable[[Message], None],
        finish: Callable[[], None],
    ) -> None:
        self._config = config
        self._parts = parts
        self._handle = handle
        self._finish = finish
        self._endpoint = endpoint
        self._outgoing = outgoing
        self._commands = commands
        self._passes = passes
        self._woken_by_passes = passes is not None and endpoint.wake_on(passes.wake_fd)  # else it looks every PASS_POLL_S

    def run(self, stop: threading.Event, ready: dict[str, str]) -> None:
        """Handle messages until ``stop`` is set, then release the endpoint. ``ready``: where the node
        is reached (``data``, ``node_id``; ``same_host``, ``admin``, ``metrics`` where it has them), for
        its log and its ready file."""
        log.info(
            "node %s serving on %s%s", ready["node_id"], ready["data"], f" (and {ready['same_host']} for workers on this host)" if "same_host" in ready else ""
        )
        if self._config.exposed_without_curve:  # allowed by --insecure; said at every start
            log.warning(
                "INSECURE: the data plane %s is reachable from the network without authentication (--insecure): anyone who reaches it can "
                "read and change the model; use --curve-secret-key/--curve-allow off a trusted network",
                ready["data"],
            )
        self._write_ready_file(ready)
        try:
            self._serve(stop)
        finally:
            updates, _store, replies = self._parts()
            updates.settle()
            replies.flush()
            self._commands.run_pending()
            self._finish()

    def _write_ready_file(self, ready: dict[str, str]) -> None:
        """Write the ready file atomically, so a reader never sees half of it."""
        ready_file = self._config.ready_file
        if not ready_file:
            return
        tmp = f"{ready_file}.tmp"
        with open(tmp, "w") as handle:
            contents: dict[str, object] = {"data": ready["data"], "pid": os.getpid(), "node_id": ready["node_id"]}
            contents.update((key, ready[key]) for key in ("same_host", "admin", "metrics") if key in ready)
            json.dump(contents, handle)
        os.replace(tmp, ready_file)

    def _serve(self, stop: threading.Event) -> None:
        """Handle messages and apply the ready updates until ``stop`` is set."""
        poll_interval_s = self._config.poll_interval_s
        while not stop.is_set():
            updates, store, replies = self._parts()  # new ones when a job is let go
            updates.finish_ended()
            if self._commands.waiting:
                updates.settle()  # an admin call sees (and may change) the node between passes
                self._commands.run_pending()
                updates, store, replies = self._parts()
            store.poll()
            if store.last_error is not None:
                updates.storage_error, store.last_error = store.last_error, None
            can_apply = updates.can_apply()
            if self._passes is not None and can_apply:
                # Handed over before any message is read: the pass thread goes from one pass to the
                # next without waiting for the loop (which then has the messages to itself).
                updates.hand_over()
                can_apply = False
            passing = updates.passing
            if replies.outbox and not can_apply and not passing:  # no more updates to add to them: the batches leave
                replies.flush()
            if can_apply:
                timeout = 0.0
            elif passing and not self._woken_by_passes:
                timeout = PASS_POLL_S
            else:  # a pass that ends wakes the wait
                timeout = poll_interval_s
            try:
                message = self._endpoint.recv(timeout)
            except WireError as exc:
                self._outgoing.log_rejected(exc, exc.peer, "rejected a malformed message: %s", exc)
                if exc.peer is not None:
                    self._outgoing.send_error(exc.peer, exc.code, exc.message)
                continue
            if message is not None:
                self._handle(message)
                continue
            updates.woken()  # by a pass that ended, or by one taken back already: the wake-up drained
            if can_apply:  # a few in a row: a look for messages costs a system call
                for _ in range(APPLY_BURST):
                    if not updates.apply_next():
                        break
