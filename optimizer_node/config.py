"""Configuration of an optimizer-node daemon."""

from __future__ import annotations

from dataclasses import dataclass

from transport.wire import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_MESSAGE_BYTES


@dataclass(kw_only=True, slots=True)
class NodeConfig:
    """Settings of one ``netoptim node`` daemon, filled from CLI flags in one place."""

    listen: str = "tcp://127.0.0.1:0"
    """Data-plane address; port 0 lets the OS choose, the bound address is logged and written to ready_file."""

    ready_file: str | None = None
    """Where to write ``{"data": ADDRESS, "pid": PID}`` as JSON once the node accepts work."""

    node_id: str = ""
    """A name for logs; defaults to the bound address."""

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest tensor payload accepted in one message; bigger ones are answered with TOO_LARGE."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Size of the frames outgoing tensors are split into."""

    send_timeout_s: float = 60.0
    """How long an update waits for the previous step's sends of the same bucket to finish."""

    poll_interval_s: float = 0.1
    """How often the serve loop wakes up to notice a stop request."""

    def validate(self) -> None:
        if self.max_message_bytes <= 0:
            raise ValueError("max_message_bytes must be positive")
        if self.chunk_bytes <= 0 or self.chunk_bytes % 8:
            raise ValueError("chunk_bytes must be a positive multiple of 8")
        if self.send_timeout_s <= 0 or self.poll_interval_s <= 0:
            raise ValueError("timeouts must be positive")
