"""Each message the node receives, to the part that handles it: :class:`MessageDispatch`.

A handler raises ``WireError`` for a message that breaks the protocol: the sender is answered with
ERROR (the error's code and text) and the rejection is logged, rate-limited. Any other exception is a
bug: it is logged with its traceback and the node goes on; the sender is answered INTERNAL, with the
exception's text only when it is a registered rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from transport.interface import Message
from transport.wire import ErrorCode, Header, MsgType, WireError

if TYPE_CHECKING:
    from optimizer_node.metrics import NodeMetrics
    from optimizer_node.serving.outgoing import Outgoing

log = logging.getLogger(__name__)

Handler = Callable[[Message], None]


class MessageDispatch:
    """Hands each message to its handler and answers what the handler refused.

    ``handlers``: by message type; ``batched_push``: the handler of a PUSH that carries a batch;
    ``check_payload_size``: the job's check of a message's declared size, before its handler;
    ``is_registered``: whether a message comes from a registered rank (who may read a bug's text);
    ``settle_for``: waits for the passes a message must not run beside, with ``pass_thread`` (the
    update passes run on a thread of their own: ``--pass-thread``)."""

    def __init__(
        self,
        handlers: Mapping[MsgType, Handler],
        batched_push: Handler,
        *,
        check_payload_size: Callable[[Header], None],
        is_registered: Callable[[Message], bool],
        settle_for: Callable[[Header, bool], None],
        outgoing: Outgoing,
        metrics: NodeMetrics,
        pass_thread: bool,
    ) -> None:
        self._handlers = handlers  # built once: handle() runs for every message
        self._batched_push = batched_push
        self._check_payload_size = check_payload_size
        self._is_registered = is_registered
        self._settle_for = settle_for
        self._outgoing = outgoing
        self._metrics = metrics
        self._pass_thread = pass_thread

    def handle(self, message: Message) -> None:
        """Handle one validated message; protocol violations are answered with ERROR. A batched PUSH
        is handled bucket by bucket, each as if it had come alone (:mod:`transport.batches`)."""
        header = message.header
        self._metrics.received(header.payload_bytes)
        batched = header.msg_type == MsgType.PUSH and "batch" in header.meta
        if self._pass_thread:  # a message is handled as if no pass ran (update_queue.py)
            self._settle_for(header, batched)
        handler = self._batched_push if batched else self._handlers.get(header.msg_type)
        try:
            if handler is None:
                raise WireError(ErrorCode.BAD_REQUEST, f"a node does not accept {header.msg_type.name} messages")
            if not batched:
                self._check_payload_size(header)
            handler(message)
        except WireError as exc:
            self._outgoing.log_rejected(
                exc, message.peer, "rejected %s from rank %s (bucket %s, step %s): %s", header.msg_type.name, header.rank, header.bucket_id, header.step, exc
            )
            self._outgoing.send_error(message.peer, exc.code, exc.message, bucket_id=header.bucket_id, step=header.step)
        except Exception as exc:  # a bug must not take the node and everyone's state down
            log.exception("internal error handling %s", header.msg_type.name)
            # The exception's text may quote the node's state: only a registered rank reads it.
            text = f"{type(exc).__name__}: {exc}" if self._is_registered(message) else "internal error; the node's log has the details"
            self._outgoing.send_error(message.peer, ErrorCode.INTERNAL, text, bucket_id=header.bucket_id, step=header.step)
