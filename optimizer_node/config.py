"""Configuration of an optimizer-node daemon."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from transport.exposure import reachable_from_network
from transport.wire import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_MESSAGE_BYTES


@dataclass(kw_only=True, slots=True)
class NodeConfig:
    """Settings of one ``netoptim node`` daemon, filled from CLI flags in one place."""

    listen: str = "tcp://127.0.0.1:0"
    """Data-plane address; port 0 lets the OS choose, the bound address is logged and written to ready_file."""

    same_host_ipc: bool = True
    """Also listen on an ipc:// socket that workers on this host switch to after their HELLO."""

    ready_file: str | None = None
    """Where to write ``{"data": ADDRESS, "pid": PID}`` as JSON once the node accepts work."""

    node_id: str = ""
    """A name for logs; defaults to the bound address."""

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest tensor payload accepted in one message; bigger ones are answered with TOO_LARGE."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Size of the frames outgoing tensors are split into."""

    io_threads: int = 1
    """I/O threads of the data plane's ZeroMQ context: raise it to the connections per node workers open."""

    send_timeout_s: float = 60.0
    """How long an update waits for the previous step's sends of the same bucket to finish."""

    poll_interval_s: float = 0.05
    """How often the serve loop wakes up to notice a stop request or an admin command."""

    checkpoint_dir: str | None = None
    """Where checkpoints go (one directory per checkpoint); none are taken without it."""

    checkpoint_every: int = 0
    """Take a checkpoint every this many steps (0: only on request, on drain and on SIGTERM)."""

    keep: int = 3
    """How many complete checkpoints to keep; older ones are removed."""

    resume: bool = False
    """Start from the newest intact checkpoint in checkpoint_dir (a fresh start if there is none)."""

    curve_secret_key: str | None = None
    """The node's CURVE ``.key_secret`` file: the data plane is encrypted and only allowed workers connect."""

    curve_allow: str | None = None
    """Directory of the ``.key`` files of the workers allowed to connect (with curve_secret_key)."""

    insecure: bool = False
    """Allow a data plane reachable from the network without CURVE (a trusted, isolated network only):
    anyone who reaches the port can then register as a rank, read the parameters and push gradients."""

    state_dir: str | None = None
    """Out-of-core mode: keep the buckets' state in files here (scratch: cleared at start)."""

    memory_budget: int | None = None
    """Out-of-core mode: bytes of bucket state held in memory at most (with state_dir)."""

    sync_state_writes: bool = False
    """Out-of-core mode: fdatasync each state write and drop it from the page cache."""

    crash_at: str | None = None
    """Testing only: exit abruptly at a crash point, see optimizer_node.faults."""

    @property
    def exposed_without_curve(self) -> bool:
        """Whether the data plane is reachable from other hosts with no CURVE authentication."""
        return not self.curve_secret_key and reachable_from_network(self.listen)

    def validate(self) -> None:
        """``ValueError`` for settings that cannot work together; ``FileNotFoundError`` (or
        ``NotADirectoryError``) when ``resume`` names a checkpoint directory that does not exist, most
        likely a mistyped path: resuming from nothing would silently start training over. An existing
        directory without a checkpoint yet is fine (a fresh start, with a warning)."""
        scheme, _, rest = self.listen.partition("://")
        if scheme != "ipc":
            _host, sep, port = rest.rpartition(":")
            if not sep or not (port == "*" or port.isdigit()):
                raise ValueError(f"listen address {self.listen!r} needs a port, like {scheme}://127.0.0.1:5555 (port 0 lets the OS choose)")
            if port.isdigit() and int(port) > 65535:
                raise ValueError(f"listen address {self.listen!r}: port {int(port)} is out of range (0 to 65535; 0 lets the OS choose)")
        if self.max_message_bytes <= 0:
            raise ValueError("max_message_bytes must be positive")
        if not 1 <= self.io_threads <= 64:
            raise ValueError(f"io_threads must be in [1, 64], not {self.io_threads}")
        if self.chunk_bytes <= 0 or self.chunk_bytes % 8:
            raise ValueError("chunk_bytes must be a positive multiple of 8")
        if self.send_timeout_s <= 0 or self.poll_interval_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.checkpoint_every < 0 or self.keep < 1:
            raise ValueError("checkpoint_every must be >= 0 and keep >= 1")
        if bool(self.curve_secret_key) != bool(self.curve_allow):
            raise ValueError("curve_secret_key and curve_allow go together")
        if self.exposed_without_curve and not self.insecure:
            how = (
                "the Mooncake transport has no encryption: run it on an isolated fabric and pass --insecure"
                if self.listen.startswith("mooncake")
                else "make keys with `netoptim keygen` and pass --curve-secret-key and --curve-allow (see docs/operations.md, Security)"
            )
            raise ValueError(
                f"{self.listen} is reachable from the network and the data plane is not authenticated: anyone who reaches it could read and "
                f"change the model. Secure it ({how}), listen on 127.0.0.1, or pass --insecure on a trusted network"
            )
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            raise ValueError("checkpoint_every and resume need checkpoint_dir")
        if bool(self.state_dir) != (self.memory_budget is not None):
            raise ValueError("state_dir and memory_budget go together (--state-dir DIR --memory-budget SIZE)")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError("memory_budget must be positive")
        if self.resume and self.checkpoint_dir and not os.path.isdir(self.checkpoint_dir):
            if os.path.exists(self.checkpoint_dir):
                raise NotADirectoryError(errno.ENOTDIR, "the checkpoint directory to resume from is not a directory", self.checkpoint_dir)
            raise FileNotFoundError(errno.ENOENT, "the checkpoint directory to resume from does not exist", self.checkpoint_dir)
