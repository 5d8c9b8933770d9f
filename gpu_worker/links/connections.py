"""A worker's connections to the optimizer nodes of its job: one per node, over the address given or
the node's same-host socket, with registration, liveness (pings, silence) and reopening after a node
restarted. It knows what is on the wire, not what a step is: :class:`~gpu_worker.session.OffloadSession`
decides what to send and what an answer means."""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable, Sequence

import torch

from gpu_worker.links.diagnosis import ask_what_nodes_wait_for
from gpu_worker.links.liveness import NodeLiveness, WorkerTimeouts
from transport import backend_for, create_transport
from transport.interface import ClientEndpoint, Message, SendHandle
from transport.wire import ErrorCode, Header, MsgType
from transport.zeromq.security import CurveClientConfig

log = logging.getLogger(__name__)

RECONNECT_PAUSE_S = 0.05
"""The first pause before a reconnect says HELLO again on a new connection after the last dropped
(doubling up to 1 s): a node that restarts within a second is caught at once, a peer that drops
every connection is not hammered."""
LINK_WARNING_S = 5.0
"""A node that has not answered after this long, where the connection says why (nothing listens there,
a failed handshake), is warned of at once, not only when the timeout ends the wait."""


class NodeError(RuntimeError):
    """An optimizer node rejected a request; ``code`` says why."""

    def __init__(self, node: str, code: int, message: str) -> None:
        try:
            name = ErrorCode(code).name
        except ValueError:
            name = str(code)
        super().__init__(f"optimizer node {node} rejected the request ({name}): {message}")
        self.node = node
        self.code = code


class NonFiniteGradientError(NodeError):
    """The nodes refused this rank's gradient of one or more buckets because it held NaN or inf
    (``netoptim node --non-finite refuse``, the default). Their parameters and moments are unchanged,
    and they keep the other ranks' gradients of those buckets: the step is still open.

    ``refusals`` lists ``(node, bucket_id, step, values)``: where, which bucket, which step, and how
    many NaN/inf values the gradient held. ``optimizer.step()`` called again with finite gradients
    pushes those buckets again and finishes the step; the other ranks only wait meanwhile. Where the
    step cannot be retried in the process (``retry=False``: layer-wise workers keep no gradients to
    push again), the message says to restart the worker, which redoes the step.
    """

    def __init__(self, rank: int, refusals: Sequence[tuple[str, int, int, int]], describe: Callable[[int], str] = str, *, retry: bool = True) -> None:
        step = refusals[0][2]
        where = "; ".join(
            f"bucket {bucket_id} ({describe(bucket_id)}): {values} NaN/inf value(s), refused by node {node}" for node, bucket_id, _, values in refusals
        )
        go_on = (
            "call optimizer.step() again with finite gradients (e.g. after p.grad.nan_to_num_()), or stop and restart from a checkpoint"
            if retry
            else f"restart this worker (it redoes step {step} and pushes only what the nodes lack), or stop and restart from a checkpoint"
        )
        RuntimeError.__init__(
            self,
            f"rank {rank}, step {step}: this rank's gradient is not finite. {where}. The nodes' parameters and moments are unchanged and they "
            f"wait for this rank's gradient of {'that bucket' if len(refusals) == 1 else 'those buckets'} (the other ranks wait too). To go on, "
            f"{go_on}. To avoid it: lower the learning rate, clip gradients (max_grad_norm), use a GradScaler (mixed precision), or run the "
            "nodes with --non-finite skip (a step with NaN/inf is then skipped everywhere, as GradScaler does)",
        )
        self.node = refusals[0][0]
        self.code = int(ErrorCode.NON_FINITE)
        self.rank = rank
        self.step = step
        self.refusals = list(refusals)


def node_error(node: str, header: Header) -> NodeError:
    """The exception for an ERROR a node sent (a :class:`NonFiniteGradientError` for NON_FINITE)."""
    code = header.meta.get("code", 0)
    if code == ErrorCode.NON_FINITE and isinstance(header.meta.get("rank"), int):
        return NonFiniteGradientError(header.meta["rank"], [(node, header.bucket_id, header.step, int(header.meta.get("values", 0)))])
    return NodeError(node, code, header.meta.get("message", ""))


class NodeConnections:
    """The connections of worker ``rank`` (process ``incarnation``) to ``nodes``, in node order."""

    def __init__(
        self,
        nodes: Sequence[str],
        rank: int,
        incarnation: int,
        job_wire: dict,
        timeouts: WorkerTimeouts,
        *,
        curve: CurveClientConfig | None = None,
        same_host: bool = True,
        connections_per_node: int = 1,
    ) -> None:
        backends = {backend_for(url) for url in nodes}
        if len(backends) > 1:
            raise ValueError(f"the nodes of a job use one transport; these addresses mix {sorted(backends)}: {list(nodes)}")
        self.nodes = list(nodes)
        self.rank = rank
        self.incarnation = incarnation
        self.timeouts = timeouts
        self.liveness = NodeLiveness(len(self.nodes), timeouts)
        self._job_wire = job_wire
        self._hello_extra: dict = {}  # morph_at while a morph is under way
        self._curve = curve
        self._same_host = same_host
        lanes = {"connections_per_peer": connections_per_node} if connections_per_node != 1 else {}
        self._transport = create_transport(self.nodes[0], curve_client=curve, **lanes)
        self._clients: list[ClientEndpoint] = [self._transport.connect(url) for url in self.nodes]
        # Batches of small buckets (transport.batches): over one ZeroMQ connection per node only.
        self.asks_for_batches = connections_per_node == 1 and backends == {"zmq"}
        self._closed = False

    def __len__(self) -> int:
        return len(self._clients)

    @property
    def addresses(self) -> list[str]:
        """Where each connection goes: the address given, or the node's same-host socket."""
        return [client.address for client in self._clients]

    def shared_memory_bytes(self) -> dict[str, int]:
        """Payload bytes that went through same-host shared memory over the connections open now:
        ``sent`` and ``received`` through the windows, and ``received`` includes ``board``, the
        parameters read in place from nodes' parameter boards."""
        shared = [client.shared for client in self._clients if getattr(client, "shared", None) is not None]
        live = [s.connection for s in shared if s.connection is not None]
        board = sum(s.board.read_bytes for s in shared if s.board is not None)
        return {"sent": sum(c.writer.written_bytes for c in live), "received": sum(c.reader.read_bytes for c in live) + board, "board": board}

    def send(self, index: int, header: Header, payload: torch.Tensor | None = None) -> SendHandle:
        return self._clients[index].send(header, payload)

    def reserve(self, index: int, nbytes: int) -> torch.Tensor | None:
        """Bytes in node ``index``'s shared window (same host) to fill with a payload and :meth:`send`
        without a copy, or ``None`` (another host, no room, too small)."""
        return self._clients[index].reserve(nbytes)

    def cancel(self, index: int, reserved: torch.Tensor) -> None:
        """Bytes :meth:`reserve` gave for node ``index`` that will not be sent."""
        self._clients[index].cancel(reserved)

    # ---------------------------------------------------------------- registration

    def set_job(self, job_wire: dict, *, rank: int | None = None, morph_at: int | None = None) -> None:
        """The job every later HELLO declares (a param group was added; or the job morphed to another
        width, this worker now ``rank``, from step ``morph_at``: said in the HELLOs until :meth:`morphed`)."""
        self._job_wire = job_wire
        if rank is not None:
            self.rank = rank
        self._hello_extra = {} if morph_at is None else {"morph_at": morph_at}

    def morphed(self) -> None:
        self._hello_extra = {}

    def send_hello(self, index: int) -> None:
        meta = {"job": self._job_wire, "incarnation": self.incarnation, "node_index": index, "batches": self.asks_for_batches, **self._hello_extra}
        self._clients[index].send(Header(msg_type=MsgType.HELLO, rank=self.rank, meta=meta))

    def registered(self, index: int, first_answer_s: float, *, fail_on_drop: bool = False) -> Message:
        """The node's HELLO_OK to the HELLO just sent (moving to its same-host socket if it has one
        here). The node must answer within ``first_answer_s`` (a NOTICE that it waits for rank 0
        counts); its HELLO_OK may then take up to ``timeout_s``. ``fail_on_drop``: ``ConnectionError`` as
        soon as the connection drops before the answer (see :meth:`expect`)."""
        hint = (
            "is this worker's public key in the node's --curve-allow directory, and curve_server_key the node's key?"
            if self._curve
            else "if the node uses CURVE, give this worker its keys."
        )
        what = f"registration (is a node running at that address and reachable from this host? {hint})"
        reply = self.expect(index, MsgType.HELLO_OK, what, first_answer_s=first_answer_s, fail_on_drop=fail_on_drop)
        same_host = reply.header.meta.get("same_host")
        if self._same_host and isinstance(same_host, str) and self._clients[index].address != same_host and reachable_here(same_host):
            reply = self._switch_to_same_host(index, same_host, what)
        self.liveness.heard(index)
        return reply

    def _switch_to_same_host(self, index: int, address: str, what: str) -> Message:
        """The node is on this host: say HELLO again over its ipc:// socket and use that connection
        (the node then answers this rank there), closing the TCP one. If the socket does not answer
        within 10 s, stay on TCP: say HELLO there again, so the node answers this rank there."""
        tcp = self._clients[index]
        self._clients[index] = self._transport.connect(address)
        try:
            self.send_hello(index)
            reply = self.expect(index, MsgType.HELLO_OK, f"registration over the same-host socket {address}", first_answer_s=min(10.0, self.timeouts.timeout_s))
        except TimeoutError as exc:
            self._clients[index].close()
            self._clients[index] = tcp
            log.warning("rank %d stays on %s: %s", self.rank, self.nodes[index], exc)
            self.send_hello(index)
            return self.expect(index, MsgType.HELLO_OK, what, first_answer_s=self.timeouts.first_answer_s)
        tcp.close()
        log.info("rank %d talks to node %s over %s (same host)", self.rank, self.nodes[index], address)
        return reply

    def reopen(self, index: int) -> None:
        """A new connection to node ``index`` at the address it was given (its same-host socket may
        be gone with the process that made it)."""
        self._clients[index].close()
        self._clients[index] = self._transport.connect(self.nodes[index])

    def reconnect(self, index: int, within_s: float) -> Message:
        """A new connection to node ``index`` (:meth:`reopen`), a HELLO, and the node's HELLO_OK within
        ``within_s`` (``TimeoutError`` otherwise). A connection that drops before the answer took the
        HELLO with it (it reached a node in its last moments, which a service manager restarts within a
        second, or a link that reset): another connection and the HELLO again, while there is time."""
        deadline = time.monotonic() + within_s
        pause = RECONNECT_PAUSE_S
        while True:
            self.reopen(index)
            self.send_hello(index)
            try:
                return self.registered(index, max(deadline - time.monotonic(), 0.0), fail_on_drop=True)
            except ConnectionError:
                if time.monotonic() + pause >= deadline:
                    raise TimeoutError(f"rank {self.rank}: node {self.nodes[index]} did not answer a HELLO within {within_s:.0f} s") from None
                log.info("rank %d: node %s: the connection dropped before it answered; saying HELLO again", self.rank, self.nodes[index])
                time.sleep(pause)  # a peer that drops every connection at once is not asked again at the loop's speed
                pause = min(2 * pause, 1.0)

    # ---------------------------------------------------------------- answers

    def expect(self, index: int, msg_type: MsgType, what: str, *, first_answer_s: float | None = None, fail_on_drop: bool = False) -> Message:
        """The node's next answer, which must be ``msg_type``. The first message must come within
        ``first_answer_s`` (default ``timeout_s``); after a NOTICE (the node is alive, e.g. waiting for
        rank 0) the answer may take ``timeout_s`` more. ``fail_on_drop``: ``ConnectionError`` as soon as
        the link drops (the request may be lost with it) rather than after the timeout."""
        timeout_s = self.timeouts.timeout_s if first_answer_s is None else first_answer_s
        message = self._recv(index, timeout_s, what, fail_on_drop)
        while message is not None and message.header.msg_type in (MsgType.NOTICE, MsgType.STATUS):
            if message.header.msg_type == MsgType.NOTICE:
                self.log_notice(index, message.header)
                timeout_s = self.timeouts.timeout_s
            message = self._recv(index, timeout_s, what, fail_on_drop)
        if message is None:
            link = self._clients[index].link_state()
            said = f"; the connection: {link}" if link else ""
            raise TimeoutError(f"rank {self.rank}: node {self.nodes[index]} did not answer within {timeout_s:.0f} s while waiting for {what}{said}")
        header = message.header
        if header.msg_type == MsgType.ERROR:
            raise node_error(self.nodes[index], header)
        if header.msg_type != msg_type:
            raise RuntimeError(f"node {self.nodes[index]} answered {header.msg_type.name}, expected {msg_type.name}")
        return message

    def _recv(self, index: int, timeout_s: float, what: str, fail_on_drop: bool) -> Message | None:
        """The next message within ``timeout_s``; with ``fail_on_drop``, looking at the link once a
        heartbeat: ``ConnectionError`` as soon as it dropped (the request awaited may be lost)."""
        client = self._clients[index]
        if not fail_on_drop:
            if timeout_s <= LINK_WARNING_S:
                return client.recv(timeout_s)
            message = client.recv(LINK_WARNING_S)
            if message is None:
                self._warn_of_the_link(index, timeout_s, what)
                message = client.recv(timeout_s - LINK_WARNING_S)
            return message
        deadline = time.monotonic() + timeout_s
        while True:
            message = client.recv(max(min(deadline - time.monotonic(), self.timeouts.heartbeat_s), 0.0))
            if message is not None or time.monotonic() >= deadline:
                return message
            if client.connection_dropped():
                raise ConnectionError(f"rank {self.rank}: the connection to node {self.nodes[index]} dropped while waiting for {what}")

    def _warn_of_the_link(self, index: int, timeout_s: float, what: str) -> None:
        """Say now what keeps node ``index`` from answering, where its connection tells for certain."""
        link = self._clients[index].link_problem()
        if link is not None:
            log.warning(
                "rank %d: no answer from node %s after %.0f s while waiting for %s: %s; still trying for %.0f s",
                self.rank,
                self.nodes[index],
                LINK_WARNING_S,
                what.split(" (", 1)[0],
                link,
                timeout_s - LINK_WARNING_S,
            )

    def wait_readable(self, timeout_s: float) -> list[int]:
        """The nodes with a message waiting, after at most ``timeout_s``."""
        return self._transport.wait_readable(self._clients, timeout_s)

    def take(self, index: int) -> Message | None:
        """Node ``index``'s next message if one is there; it marks the node as heard from."""
        message = self._clients[index].recv(0.0)
        if message is not None:
            self.liveness.heard(index)
        return message

    def say_bye(self, wait_s: float) -> list[int]:
        """Tell every node this rank is done (BYE) and wait up to ``wait_s`` for each one's ACK, so that
        a node knows before this process goes whether its job is finished; what else arrives meanwhile
        is dropped; a node silent for ``silent_after_s`` already is not waited for. Returns the nodes that
        did not answer (gone, or slow)."""
        for index in range(len(self._clients)):
            self._clients[index].send(Header(msg_type=MsgType.BYE, rank=self.rank))
        # Not from a node already silent past the limit (gone: what stopped this worker, often), nor
        # from one whose link dropped (a node stopped or killed): a worker's exit must not wait on it.
        pending = {index for index in range(len(self._clients)) if self.liveness.silent_for(index) < self.timeouts.silent_after_s}
        deadline = time.monotonic() + wait_s
        while pending and (left := deadline - time.monotonic()) > 0:
            pending -= {index for index in pending if self._clients[index].connection_dropped()}
            for index in self.wait_readable(min(left, 0.1)):
                message = self.take(index)
                if message is not None and message.header.msg_type in (MsgType.ACK, MsgType.ERROR) and message.header.meta.get("bye", True):
                    pending.discard(index)  # an ERROR: the node does not count this rank (any more); nothing to wait for
        return sorted(pending)

    def dropped(self) -> list[int]:
        """The nodes whose link dropped since the last call (what was in flight may be lost)."""
        return [index for index, client in enumerate(self._clients) if client.connection_dropped()]

    def ping(self, indices: Sequence[int]) -> None:
        """Ask these nodes for their status: a STATUS back says they are alive."""
        for index in indices:
            self._clients[index].send(Header(msg_type=MsgType.QUERY, rank=self.rank))

    def log_notice(self, index: int, header: Header) -> None:
        if isinstance(header.meta.get("non_finite"), dict):
            refused = header.meta["non_finite"]
            log.warning(
                "node %s refused rank %s's gradient of bucket %s at step %s (%s NaN/inf values): this worker waits until that rank pushes it again",
                self.nodes[index],
                refused.get("rank"),
                refused.get("bucket"),
                refused.get("step"),
                refused.get("values"),
            )
        elif header.meta.get("waiting_for"):
            log.info("node %s: %s", self.nodes[index], header.meta["waiting_for"])
        elif header.meta.get("paused"):
            log.warning("node %s paused updates: %s; this worker waits (timeout %.0f s)", self.nodes[index], header.meta.get("reason"), self.timeouts.timeout_s)
        else:
            log.warning("node %s resumed updates", self.nodes[index])

    def accounts(self) -> list[str]:
        """Per node, what the node says it waits for (for a timeout's message)."""
        accounts = ask_what_nodes_wait_for(self._clients, self.rank, min(5.0, self.timeouts.timeout_s))
        return [f"node {self.nodes[index]}: {account}" for index, account in enumerate(accounts)]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for client in self._clients:
            client.close()
        self._transport.close()


def reachable_here(address: str) -> bool:
    """An ipc:// address whose socket file exists on this host (a node elsewhere has its own)."""
    if not address.startswith("ipc://"):
        return False
    try:
        return stat.S_ISSOCK(os.stat(address[len("ipc://") :]).st_mode)
    except OSError:
        return False
