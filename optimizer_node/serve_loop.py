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
from typing import TYPE_CHECKING, Protocol

from transport.wire import WireError

if TYPE_CHECKING:
    from optimizer_node.config import NodeConfig
    from optimizer_node.control import CommandQueue, StepClock
    from optimizer_node.serving.outgoing import Outgoing
    from optimizer_node.serving.replies import ParameterReplies
    from optimizer_node.state.persistence import Checkpoints
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


class ServedNode(Protocol):
    """What the loop reads and asks of the daemon: who it is and where it is reached, the job's parts
    of the moment (letting a job go makes new ones), the handling of a message, and its close."""

    config: NodeConfig
    node_id: str
    address: str
    same_host_address: str | None
    admin_address: str | None
    metrics_address: str | None
    clock: StepClock

    @property
    def step(self) -> int: ...
    @property
    def updates(self) -> UpdateQueue: ...
    @property
    def store(self) -> BucketStore: ...
    @property
    def replies(self) -> ParameterReplies: ...
    @property
    def checkpoints(self) -> Checkpoints: ...
    def handle(self, message: Message) -> None: ...
    def close(self) -> None: ...


class ServeLoop:
    """Receives each message and has the daemon handle it, applies the ready updates, runs the admin
    service's calls.

    ``commands``: those calls; ``passes``: the node's pass thread, ``None`` without ``--pass-thread``."""

    def __init__(
        self, node: ServedNode, endpoint: ServerEndpoint, outgoing: Outgoing, commands: CommandQueue, passes: PassThread[PendingUpdate] | None
    ) -> None:
        self._node = node
        self._endpoint = endpoint
        self._outgoing = outgoing
        self._commands = commands
        self._passes = passes
        self._woken_by_passes = passes is not None and endpoint.wake_on(passes.wake_fd)  # else it looks every PASS_POLL_S

    def run(self, stop: threading.Event) -> None:
        """Handle messages until ``stop`` is set, then release the endpoint."""
        node = self._node
        log.info(
            "node %s serving on %s%s", node.node_id, node.address, f" (and {node.same_host_address} for workers on this host)" if node.same_host_address else ""
        )
        if node.config.exposed_without_curve:  # allowed by --insecure; said at every start
            log.warning(
                "INSECURE: the data plane %s is reachable from the network without authentication (--insecure): anyone who reaches it can "
                "read and change the model; use --curve-secret-key/--curve-allow off a trusted network",
                node.address,
            )
        self._write_ready_file()
        try:
            self._serve(stop)
        finally:
            node.updates.settle()
            node.replies.flush()
            self._commands.run_pending()
            node.checkpoints.on_exit()
            node.clock.close()
            node.close()
        log.info("node %s stopped at step %s", node.node_id, node.step)

    def _write_ready_file(self) -> None:
        """Write the ready file atomically, so a reader never sees half of it."""
        node = self._node
        if not node.config.ready_file:
            return
        tmp = f"{node.config.ready_file}.tmp"
        with open(tmp, "w") as handle:
            ready = {"data": node.address, "pid": os.getpid(), "node_id": node.node_id}
            if node.same_host_address:
                ready["same_host"] = node.same_host_address
            if node.admin_address:
                ready["admin"] = node.admin_address
            if node.metrics_address:
                ready["metrics"] = f"http://{node.metrics_address}/metrics"
            json.dump(ready, handle)
        os.replace(tmp, node.config.ready_file)

    def _serve(self, stop: threading.Event) -> None:
        """Handle messages and apply the ready updates until ``stop`` is set."""
        node = self._node
        poll_interval_s = node.config.poll_interval_s
        while not stop.is_set():
            updates = node.updates  # a new queue when a job is let go
            updates.finish_ended()
            if self._commands.waiting:
                updates.settle()  # an admin call sees (and may change) the node between passes
                self._commands.run_pending()
                updates = node.updates
            store = node.store
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
            replies = node.replies
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
                node.handle(message)
                continue
            updates.woken()  # by a pass that ended, or by one taken back already: the wake-up drained
            if can_apply:  # a few in a row: a look for messages costs a system call
                for _ in range(APPLY_BURST):
                    if not updates.apply_next():
                        break
