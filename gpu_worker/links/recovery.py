"""A worker's side of an optimizer node that went away and came back.

When a node's connection drops or the node goes silent (:mod:`gpu_worker.links.liveness`), the receive loop
asks :class:`NodeRecovery` to reach it again at the address it was given. The node says where it is
(a restarted node resumes from its last checkpoint): what it lost of this rank's gradients of the
step in progress is pushed again, and the values this worker waits for are asked for again, since
the node may have sent them to the connection this one replaced. What the node lost is worked out by
:func:`gpu_worker.links.resume.gradients_lost`; this module acts on it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gpu_worker.links.registration import NodeRegistration, resume_account
from gpu_worker.links.resume import WorkerProgress, gradients_lost
from transport.interface import Message

if TYPE_CHECKING:
    from gpu_worker.exchange.awaited_values import AwaitedValues
    from gpu_worker.exchange.gradient_pushes import GradientPushes
    from gpu_worker.links.connections import NodeConnections
    from gpu_worker.links.liveness import WorkerTimeouts
    from gpu_worker.links.messages import NodeMessages
    from gpu_worker.links.news import NodeNews
    from gpu_worker.links.rank_state import RankState

log = logging.getLogger(__name__)


class NodeRecovery:
    """Reconnects to a node that went away and brings it up to date with this rank.

    ``reconnected``: the nodes this process reconnected to: a bucket's values may come twice from them
    (asked for again and broadcast), the second copy even after the step that awaited them ended.
    ``state``: this rank's place in the job, read at each reconnect. ``advanced_at`` (layer-wise; the session keeps it): bucket -> the step this process last pushed it
    for."""

    def __init__(
        self,
        state: RankState,
        connections: NodeConnections,
        registration: NodeRegistration,
        timeouts: WorkerTimeouts,
        *,
        pushes: GradientPushes,
        values: AwaitedValues,
        messages: NodeMessages,
        news: NodeNews,
        advanced_at: dict[int, int],
    ) -> None:
        self._state = state
        self._connections = connections
        self._registration = registration
        self._timeouts = timeouts
        self._pushes = pushes
        self._values = values
        self._messages = messages
        self._news = news
        self._advanced_at = advanced_at
        self.reconnected: set[int] = set()

    def has_reconnected(self, node_index: int) -> bool:
        """Whether this worker reconnected to node ``node_index`` (values asked for again may come twice)."""
        return node_index in self.reconnected

    def reconnect(self, index: int, why: str | None = None) -> None:
        """Reach node ``index`` again at the address it was given (its same-host socket may be gone
        with it) and continue where it is: push again what it lost, ask again for what is awaited."""
        state, timeouts = self._state, self._timeouts
        address = state.nodes[index]
        silent = self._connections.liveness.silent_for(index)
        why = why or f"it has not answered for {silent:.0f} s"
        log.warning("rank %d: node %s: %s; reconnecting (for up to %.0f s)", state.rank, address, why, timeouts.reconnect_s)
        self._pushes.sender.forget(index)
        try:
            reply = self._registration.reconnect(index, timeouts.reconnect_s, state.buckets)
        except TimeoutError:
            raise ConnectionError(
                f"rank {state.rank}, step {state.step}: node {address} stopped answering ({why}) and did not come back within "
                f"{timeouts.reconnect_s:.0f} s: restart it with the same flags plus --resume (the workers reconnect by themselves), or check the network"
            ) from None
        self._resync(index, reply)

    def _resync(self, index: int, reply: Message) -> None:
        state, values, pushes = self._state, self._values, self._pushes
        self.reconnected.add(index)
        meta = reply.header.meta
        address = state.nodes[index]
        mine = [b.bucket_id for b in state.buckets if b.node == index]
        node_step, held = resume_account(reply)
        contributed = set(held)
        progress = WorkerProgress(
            state.rank,
            state.job.mode == "layerwise",
            mine,
            state.bucket_steps,
            self._news.seen_step(index),
            self._advanced_at,
            pushes.pushed,
            keeps_gradients=values.grads is not None,
        )
        step, lost = gradients_lost(address, node_step, contributed, bool(meta.get("needs_init")), progress)
        log.warning("rank %d: node %s is back at step %d; pushing %d bucket(s) again", state.rank, address, node_step, len(lost))
        for bucket_id in lost:
            if state.bucket_steps[bucket_id] > step:  # installed from the node's previous life: it comes again
                values.await_again(bucket_id, step)
        # Ask first: a request that reaches the node before the push that completes the bucket is
        # answered once, at the update, instead of the update's broadcast.
        asked = dict(self._messages.requests)  # what the node's previous life was asked for
        asked.update({b: state.bucket_steps[b] + 1 for b in values.waiting})
        if state.job.mode != "layerwise":
            # Pushed this step (a paced worker reconnects in the middle of backward, before the step
            # awaits anything) and not back: the node may have sent the new values to the connection
            # this one replaced, where they are lost. Asked for, they come once more; a copy that came
            # twice is known by its step (see AwaitedValues.install).
            asked.update({b: at + 1 for b, at in pushes.pushed.items() if at == state.bucket_steps[b]})
        for bucket_id, at_step in sorted(asked.items()):
            if state.buckets[bucket_id].node == index:
                self._messages.request(bucket_id, at_step)
        if lost:
            grads, hypers = values.grads  # type: ignore[misc]
            for bucket_id in lost:
                pushes.pushed.pop(bucket_id, None)
                pushes.push_bucket(bucket_id, grads, hypers)
