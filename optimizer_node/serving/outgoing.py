"""Every message a node sends, and what it says of the messages it rejects.

:class:`Outgoing` (node-wide, composed by the daemon) keeps a peer's messages in order (the new
values batched for it leave first), bounds the answers waiting for peers outside the job (a peer
that sends requests and never reads the answers must not grow the send queue: see
:mod:`optimizer_node.serving.reply_budget`), sends a bucket's values that every rank gets through the
parameter board where the peer reads it, and keeps each PARAMS send's handle on its bucket (its
next update waits for them). Rejections are logged at a bounded rate where any peer can cause them
as often as it likes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from transport.wire import ErrorCode, Header, MsgType, WireError, error_header

if TYPE_CHECKING:
    import torch

    from optimizer_node.log_limits import RateLimitedLog
    from optimizer_node.metrics import NodeMetrics
    from optimizer_node.serving.reply_budget import UnregisteredReplyBudget
    from transport.interface import SendHandle, ServerEndpoint

log = logging.getLogger(__name__)


class Outgoing:
    """The node's sends and its rejections' log lines. The job of the moment (letting a job go makes a
    new one) through three callables: ``is_rank_connection`` (whether a peer is a connection of one of
    the job's ranks), ``flush_queued`` (the values batched for a peer leave first) and ``params_sent``
    (a PARAMS send's handle, kept on its bucket)."""

    def __init__(
        self,
        endpoint: ServerEndpoint,
        outsider_budget: UnregisteredReplyBudget,
        limit_log: RateLimitedLog,
        *,
        metrics: NodeMetrics,
        is_rank_connection: Callable[[bytes], bool],
        flush_queued: Callable[[bytes], None],
        params_sent: Callable[[int, SendHandle], None],
    ) -> None:
        self._endpoint = endpoint
        self._metrics = metrics
        self._is_rank_connection = is_rank_connection
        self._flush_queued = flush_queued
        self._params_sent = params_sent
        self.outsider_budget = outsider_budget  # answers to peers outside the job, not yet sent
        self._limit_log = limit_log

    def send(self, peer: bytes, header: Header, payload: torch.Tensor | None = None, *, published: tuple[int, tuple[int, int]] | None = None) -> None:
        """Reply to ``peer``. ``published``: the payload is a bucket's values of a version (its
        revision and step) that every rank is sent; a rank on this host may read them from the
        parameter board (a rank pushes the gradients computed from them before the bucket's next
        version exists, so nobody reads a version the board no longer holds)."""
        self._flush_queued(peer)  # what was queued for the peer goes first: its messages keep their order
        outsider = not self._is_rank_connection(peer)
        if outsider:  # a peer outside the job may not read its answers: what waits for it is bounded
            nbytes = header.payload_bytes + len(header.meta.get("message", "")) + 64
            if not self.outsider_budget.admits(peer, nbytes):
                self._limit_log.log(
                    "unread-replies",
                    logging.WARNING,
                    "dropped a %s to peer %s: peers outside the job have %d bytes of answers they have not read (--max-unread-reply-bytes %d)",
                    header.msg_type.name,
                    peer.hex()[:16],
                    self.outsider_budget.held_bytes,
                    self.outsider_budget.total_bytes,
                )
                return
        try:
            if published is not None and payload is not None and not outsider:
                handle = self._endpoint.send_published(peer, header, payload, *published)
            else:
                handle = self._endpoint.send(peer, header, payload, track=outsider)
        except ConnectionError as exc:
            log.warning("could not reply %s: %s", header.msg_type.name, exc)
            return
        if outsider:
            self.outsider_budget.queued(peer, handle, nbytes)
        self._metrics.sent(header.payload_bytes)
        if payload is not None and header.msg_type == MsgType.PARAMS:
            self._params_sent(header.bucket_id, handle)

    def send_error(self, peer: bytes, code: ErrorCode, text: str, *, bucket_id: int = -1, step: int = -1) -> None:
        """An ERROR to ``peer``, counted as a rejected message."""
        self._metrics.rejected_message()
        self.send(peer, error_header(code, text, bucket_id=bucket_id, step=step))

    def log_rejected(self, exc: WireError, peer: bytes | None, text: str, *args: object) -> None:
        """Warn of a rejected message. What any peer can run into as often as it likes is said at most
        once every few seconds: a limit (LIMIT, TOO_LARGE), per limit (the flag its message names), and
        every rejection of a peer outside the job, per error code; a rank's rejections each."""
        if exc.code in (ErrorCode.LIMIT, ErrorCode.TOO_LARGE):
            flag = re.search(r"--[a-z][a-z-]*", exc.message)
            self._limit_log.log(f"{exc.code.name} {flag.group() if flag else ''}", logging.WARNING, text, *args)
        elif peer is None or not self._is_rank_connection(peer):
            self._limit_log.log(f"outsider {exc.code.name}", logging.WARNING, text, *args)
        else:
            log.warning(text, *args)
