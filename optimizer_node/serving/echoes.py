"""ECHO: a peer's own payload, step and bucket id sent back, for measuring the path to a node
(``netoptim bench transport``) with nothing of the node's state in it. The node sends what it
received without a copy, so a peer that echoes without reading the answers would pin as much memory
as it cares to send: :class:`EchoReplies` bounds the bytes on their way back."""

from __future__ import annotations

import logging
from collections.abc import Callable

from transport.interface import Message, SendHandle, ServerEndpoint
from transport.wire import ErrorCode, Header, MsgType, WireError, tensor_header

log = logging.getLogger(__name__)


class EchoReplies:
    """The node's answers to ECHO, and the echoes still on their way back.

    ``send`` is the daemon's reply path for an echo without payload; ``sent_bytes`` counts what an
    echo sends; ``max_bytes``: echoes on their way back at once (``--max-echo-bytes``)."""

    def __init__(
        self, endpoint: ServerEndpoint, send: Callable[[bytes, Header], None], sent_bytes: Callable[[int], None], *, max_bytes: int, chunk_bytes: int
    ) -> None:
        self._endpoint = endpoint
        self._send = send
        self._sent_bytes = sent_bytes
        self._max_bytes = max_bytes
        self._chunk_bytes = chunk_bytes
        self._in_flight: list[tuple[SendHandle, int]] = []  # payloads not yet handed to the OS, and their bytes

    def on_echo(self, message: Message) -> None:
        """Send the peer's payload, step and bucket id back; ``WireError`` (LIMIT) when the echoes still
        on their way back would hold more than ``max_bytes``."""
        header = message.header
        if not message.tensors:
            self._send(message.peer, Header(msg_type=MsgType.ECHO))
            return
        self._in_flight = [(handle, size) for handle, size in self._in_flight if not handle.done()]
        pending = sum(size for _handle, size in self._in_flight)
        if pending + header.payload_bytes > self._max_bytes:
            raise WireError(
                ErrorCode.LIMIT,
                f"an ECHO of {header.payload_bytes} bytes would put more than {self._max_bytes} bytes of echoes on their way back at once "
                "(--max-echo-bytes): read the echoes before sending more",
            )
        payload = [view for _offset, view in message.tensors]  # the received frames go back uncopied
        reply = tensor_header(MsgType.ECHO, payload, self._chunk_bytes, step=header.step, bucket_id=header.bucket_id)
        try:
            handle = self._endpoint.send(message.peer, reply, payload)
        except ConnectionError as exc:
            log.warning("could not reply ECHO: %s", exc)
            return
        self._sent_bytes(reply.payload_bytes)
        self._in_flight.append((handle, reply.payload_bytes))
