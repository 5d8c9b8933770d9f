"""A worker's registration with its job's nodes: HELLO to each, and each node's HELLO_OK checked.

A node answers HELLO with the buckets it owns, whether it takes batched pushes, its ``--non-finite``
policy, the buckets still waiting for initial values and where this rank stands with it (its step for
the rank, and the buckets whose gradient of that step it already holds). :class:`NodeRegistration`
checks each answer against the plan and against the other nodes' answers; what the session does with
the accounts (the step it resumes at) stays with the session.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from gpu_worker.links.connections import NodeConnections
from protos.job.placement import BucketSpec
from transport.interface import Message

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Registered:
    """What the nodes answered to a HELLO round."""

    needs_init: list[int]  # buckets without initial values yet (rank 0 sends them), ascending
    resume: dict[int, tuple[int, list[int]]]  # node index -> (its step for this rank, buckets holding this rank's gradient of it)


def resume_account(reply: Message) -> tuple[int, list[int]]:
    """A HELLO_OK's account of this rank: the node's step for it, and the buckets whose gradient of
    that step it holds already."""
    meta = reply.header.meta
    return int(meta["resume_step"]), [int(b) for b in meta["contributed"]]


class NodeRegistration:
    """Says HELLO to every node and checks each answer. ``batching_nodes`` is the set of nodes that take
    batched pushes, which each answer updates (the gradient pushes read it)."""

    def __init__(self, connections: NodeConnections, nodes: Sequence[str], batching_nodes: set[int]) -> None:
        self._connections = connections
        self._nodes = list(nodes)
        self._batching_nodes = batching_nodes
        self._non_finite_policies: dict[int, str] = {}  # node index -> its --non-finite policy, as its HELLO_OK said
        self.said_hello = False  # registered with the nodes: closing says BYE

    def hello(self, buckets: Sequence[BucketSpec], answer_s: float) -> Registered:
        """HELLO to every node, then each one's HELLO_OK, checked, within ``answer_s`` each."""
        for index in range(len(self._connections)):
            self._connections.send_hello(index)
        needs_init: list[int] = []
        resume: dict[int, tuple[int, list[int]]] = {}
        for index in range(len(self._connections)):
            reply = self.checked(index, self._connections.registered(index, answer_s), buckets)
            needs_init += reply.header.meta.get("needs_init", [])
            resume[index] = resume_account(reply)
        self._connections.morphed()  # a joiner's morph_at: said once
        self.said_hello = True
        return Registered(sorted(needs_init), resume)

    def reconnect(self, index: int, within_s: float, buckets: Sequence[BucketSpec]) -> Message:
        """A new connection to node ``index`` and its HELLO_OK, checked (``TimeoutError`` past ``within_s``)."""
        return self.checked(index, self._connections.reconnect(index, within_s), buckets)

    def checked(self, index: int, reply: Message, buckets: Sequence[BucketSpec]) -> Message:
        """Node ``index``'s HELLO_OK, checked against the plan and the other nodes' policies."""
        owned = sorted(b.bucket_id for b in buckets if b.node == index)
        if reply.header.meta.get("owned") != owned:
            raise RuntimeError(f"node {self._nodes[index]} owns buckets {reply.header.meta.get('owned')}, the plan says {owned}")
        if reply.header.meta.get("batches") is True and self._connections.asks_for_batches:
            self._batching_nodes.add(index)
        else:
            self._batching_nodes.discard(index)
        policy = reply.header.meta.get("non_finite")
        if isinstance(policy, str):
            self._non_finite_policies[index] = policy
            other = next((i for i, theirs in self._non_finite_policies.items() if theirs != policy), None)
            if other is not None:
                raise RuntimeError(
                    f"node {self._nodes[index]} runs with --non-finite {policy}, node {self._nodes[other]} with --non-finite "
                    f"{self._non_finite_policies[other]}: the nodes of a job must agree (a skipped step must be skipped on every node); "
                    "restart them with the same --non-finite"
                )
        return reply

    def say_bye(self, within_s: float) -> None:
        """Tell every node this rank is done (once, and only if it said HELLO); a node already gone is
        noted, not an error."""
        if not self.said_hello:
            return
        self.said_hello = False
        try:
            silent = self._connections.say_bye(within_s)
            if silent:
                log.debug("rank %d: no answer to BYE from node(s) %s", self._connections.rank, [self._nodes[i] for i in silent])
        except Exception as exc:  # a node already gone: nothing to tell it
            log.debug("rank %d: BYE not sent: %s", self._connections.rank, exc)
