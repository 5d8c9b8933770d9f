"""Configuration of an optimizer-node daemon."""

from __future__ import annotations

import dataclasses
import errno
import os
from dataclasses import dataclass

from protos.job.spec import (
    DEFAULT_MAX_JOB_BUCKETS,
    DEFAULT_MAX_JOB_ELEMENTS,
    DEFAULT_MAX_JOB_NODES,
    DEFAULT_MAX_JOB_PARAMS,
    DEFAULT_MAX_WORLD_SIZE,
    JobLimits,
)
from transport import backend_for
from transport.exposure import reachable_from_network
from transport.wire import DEFAULT_CHUNK_BYTES, MAX_HEADER_BYTES

DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
"""A node's default payload limit: the largest bucket a job may have is a quarter of it in elements
(rank 0 sends initial values as fp32). Lower than the wire's own default (2 GiB): a node takes
payloads from peers it may not trust."""

MIN_HEADER_BYTES = 4 << 10
"""The lowest max_header_bytes accepted: every message but a HELLO has a header of a few hundred bytes."""


@dataclass(kw_only=True, slots=True)
class NodeConfig:
    """Settings of one ``netoptim node`` daemon, filled from CLI flags in one place."""

    listen: str = "tcp://127.0.0.1:0"
    """Data-plane address; port 0 lets the OS choose, the bound address is logged and written to ready_file."""

    same_host_ipc: bool = True
    """Also listen on an ipc:// socket that workers on this host switch to after their HELLO."""

    same_host_window_mb: int = 64
    """Shared memory a worker on this host's ipc:// socket gets for its payloads, each way, in MiB
    (pages are allocated as first written); 0 keeps its payloads on the socket."""

    same_host_gradient_window: bool = True
    """Give each same-host worker a window for its gradients that holds a whole step of its pushes to
    this node (its share of the job's gradients in the wire dtype; pages allocated as first written),
    so that it gathers them straight into shared memory (out of core too: the memory plan counts a step
    of gradients either way, and over the socket they cost the node a copy on ZeroMQ's I/O thread).
    Off: that window is ``same_host_window_mb`` too, and what does not fit goes on the socket."""

    same_host_board: bool | None = None
    """Keep the values sent (in the wire dtype) in a read-only parameter board that every same-host
    worker with windows installs from, instead of a copy into each worker's window at each fetch;
    only where the host's available memory holds it. ``None``: in memory yes, out of core no (two
    copies of the share in the wire dtype beside the memory budget: in fp32 two thirds of the state);
    ``True`` out of core too: then the workers install straight from it (a GPU's copies read it in
    place) and a fetch of a bucket not in memory reads no file. See :attr:`board_wanted`."""

    masters_on_board: bool = True
    """fp32 in memory with a parameter board: the board's two slots are the master values, each
    update writing beside the version it reads (``--masters-on-board``); False: updated in place and
    copied onto the board, as before."""

    ready_file: str | None = None
    """Where to write ``{"data": ADDRESS, "pid": PID}`` as JSON once the node accepts work."""

    node_id: str = ""
    """A name for logs; defaults to the bound address."""

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest tensor payload accepted in one message; bigger ones are answered with TOO_LARGE. Once a
    job is registered, the limit is its largest bucket (fp32) if that is lower; a job whose largest
    bucket would be over it is refused at HELLO with LIMIT."""

    max_frame_bytes: int | None = None
    """Largest frame accepted (ZeroMQ's MAXMSGSIZE: a peer that sends a larger one is disconnected
    before the frame is allocated, and gets no answer). ``None``: the largest frame the protocol
    sends, ``max(chunk_bytes, 4 MiB, max_header_bytes)``; it cannot be set lower than that."""

    max_header_bytes: int = 1 << 20
    """Largest header frame accepted; larger ones are answered with TOO_LARGE. Decoding a header can
    take up to ~70 times its size in memory for a moment (msgpack objects), and a HELLO names every
    parameter (~60-100 bytes each): 1 MiB holds ~10,000 parameters."""

    max_peers: int = 1 << 16
    """Distinct peers (client connections) the node keeps track of; a new one beyond them is answered
    with LIMIT unless the one heard from least recently has been silent for 5 minutes."""

    max_job_params: int = DEFAULT_MAX_JOB_PARAMS
    """Parameters a job may declare in its HELLO; more are answered with LIMIT."""

    max_job_elements: int = DEFAULT_MAX_JOB_ELEMENTS
    """Elements (all parameters together) a job may declare; more are answered with LIMIT. The node's
    memory (or --state-dir disk) must hold its share too, or the HELLO gets CANNOT_FIT."""

    max_job_buckets: int = DEFAULT_MAX_JOB_BUCKETS
    """Buckets a job may have (its elements over its bucket size, at least); more are answered with
    LIMIT. Planning costs ~0.4 KB of memory and ~10 us per bucket, on every node."""

    max_world_size: int = DEFAULT_MAX_WORLD_SIZE
    """Workers a job may declare; more are answered with LIMIT."""

    max_job_nodes: int = DEFAULT_MAX_JOB_NODES
    """Optimizer nodes a job may declare; more are answered with LIMIT."""

    max_waiting_hellos: int = 4096
    """HELLOs of ranks other than 0 held until rank 0 registers the job; more are answered with LIMIT."""

    max_waiting_hello_bytes: int = 16 << 20
    """Bytes those held HELLOs may take (their layouts as encoded, each distinct one once, plus ~0.5 KB
    per HELLO); a HELLO beyond it is answered with LIMIT."""

    max_unread_reply_bytes: int = 16 << 20
    """Bytes of answers to peers outside the job (not registered as a rank) that may wait in the node's
    send queue, all such peers together (one peer: a 16th of it); answers beyond are dropped. The job's
    ranks are not counted: they read what they are sent."""

    max_echo_bytes: int = 16 << 20
    """ECHO payload bytes (sent back without a copy) that may be on their way back at once; an ECHO
    beyond is answered with LIMIT. Transport benchmarks that echo more in one round raise it."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Size of the frames outgoing tensors are split into."""

    io_threads: int = 1
    """I/O threads of the data plane's ZeroMQ context: raise it to the connections per node workers open."""

    pass_thread: bool = False
    """Run the update passes on a thread of their own, so the serve loop checks and takes pushes and
    sends new values while they run (:mod:`optimizer_node.update.pass_thread`); in memory only (refused
    with ``state_dir``: an out-of-core node updates on its loop's thread)."""

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

    state_io_threads: int = 2
    """Out-of-core mode: threads that read state files, and as many that write them. Each read or
    write is one file, copied and checksummed (XXH3-64) on its thread, so where the page cache or a
    fast disk serves the state these threads' CPU, not the disk, bounds the node; a node with cores
    to spare (a GPU host's) can give them more."""

    non_finite: str = "refuse"
    """What to do with a gradient that holds NaN or inf (checked before it touches any state):
    ``refuse`` answers the push with NON_FINITE (naming rank, bucket and step) and keeps the bucket as
    it was; ``skip`` skips the whole step on every bucket of every node, as torch's GradScaler skips
    ``optimizer.step()`` (parameters, moments and AdamW's step count unchanged). Every node of a job
    needs the same policy."""

    non_finite_check: str = "worker"
    """Who checks a push for NaN/inf: ``worker`` takes a worker's word that its gradient is finite
    (a GPU worker sums each bucket on the device before copying it out, nearly free there; a push
    without that word is checked here, as every push of a CPU worker is); ``node`` checks every push
    here, at the cost of one more read of each gradient on the node's memory bus."""

    next_job: str = "take"
    """When every rank of the job has closed its optimizer (the job is finished): ``take`` lets the job
    go (checkpointed, its checkpoints archived under ``finished/``) as soon as rank 0 of another job
    says HELLO; ``refuse`` keeps it until an operator calls ``netoptim admin reset``."""

    crash_at: str | None = None
    """Testing only: exit abruptly at a crash point, see optimizer_node.faults."""

    @property
    def exposed_without_curve(self) -> bool:
        """Whether the data plane is reachable from other hosts with no CURVE authentication."""
        return not self.curve_secret_key and reachable_from_network(self.listen)

    @property
    def state_at_risk(self) -> str:
        """What a crash of this node loses of its job's state, and how to keep it; ``""`` when periodic
        checkpoints keep it (a crash then loses at most the steps since the last one)."""
        if not self.checkpoint_dir:
            return (
                "no checkpoints: a crash of this node loses the job's fp32 masters and optimizer state for good; "
                "start it with --checkpoint-dir DIR --checkpoint-every N (and --resume to restart from them)"
            )
        if not self.checkpoint_every:
            return (
                "checkpoints only on request, on drain and on SIGTERM: a crash loses every step since the last one; "
                "add --checkpoint-every N for one every N steps"
            )
        return ""

    @property
    def board_wanted(self) -> bool:
        """Whether a registered job gets a parameter board (``same_host_board``, by default in memory only)."""
        return self.same_host_board if self.same_host_board is not None else not self.state_dir

    @property
    def retain_previous(self) -> bool:
        """Whether a bucket's values of the step in flight are kept for a rank that restarts: in memory
        only; an out-of-core node would need its budget again for them."""
        return not self.state_dir

    @property
    def store_io_threads(self) -> int:
        """The threads that read and write state files: ``state_io_threads`` each way out of core, else none."""
        return 2 * self.state_io_threads if self.state_dir else 0

    @property
    def compiled_update(self) -> bool:
        """Whether the compiled update loop may be used: it brings numba and LLVM, ~140 MB of RSS, not
        for an out-of-core node, held to a memory budget."""
        return not self.state_dir

    @property
    def batch_params(self) -> bool:
        """Whether small buckets' new values leave batched per worker: not out of core, where a bucket's
        tensors go back to the store's pool once released, so its values must leave at once."""
        return not self.state_dir

    @property
    def frame_limit_bytes(self) -> int:
        """The frame cap in force: ``max_frame_bytes``, or the default it has when ``None``."""
        from transport.zeromq.backend import default_max_frame_bytes

        return default_max_frame_bytes(self.chunk_bytes, self.max_header_bytes) if self.max_frame_bytes is None else self.max_frame_bytes

    def job_limits(self) -> JobLimits:
        """The largest job this node takes, as :meth:`JobSpec.check_limits` checks it."""
        return JobLimits(
            max_params=self.max_job_params,
            max_elements=self.max_job_elements,
            max_buckets=self.max_job_buckets,
            max_world_size=self.max_world_size,
            max_nodes=self.max_job_nodes,
        )

    def endpoint_limits(self) -> dict[str, int | None]:
        """The limits the ZeroMQ backend enforces on the node's endpoint (frames, headers, peers); other
        backends have their own bounds (Mooncake: its receive windows)."""
        if backend_for(self.listen) != "zmq":
            return {}
        return {
            "max_frame_bytes": self.max_frame_bytes,
            "max_header_bytes": self.max_header_bytes,
            "max_peers": self.max_peers,
            "same_host_window_bytes": self.same_host_window_mb << 20,
        }

    def _validate_limits(self) -> None:
        """``ValueError`` for a resource limit that is not a positive integer, or too small to work."""
        for name in ("max_peers", "max_waiting_hellos", "max_waiting_hello_bytes", "max_unread_reply_bytes", "max_echo_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.job_limits().validate()
        if not MIN_HEADER_BYTES <= self.max_header_bytes <= MAX_HEADER_BYTES:
            raise ValueError(f"max_header_bytes must be in [{MIN_HEADER_BYTES}, {MAX_HEADER_BYTES}] (the protocol's own limit), got {self.max_header_bytes}")
        if self.max_frame_bytes is not None:
            floor = dataclasses.replace(self, max_frame_bytes=None).frame_limit_bytes
            if self.max_frame_bytes < floor:
                raise ValueError(
                    f"max_frame_bytes {self.max_frame_bytes} is below the largest frame workers send ({floor} bytes: a payload chunk or a header "
                    "of max_header_bytes); peers would be disconnected"
                )

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
        if not 0 <= self.same_host_window_mb <= 1 << 16:
            raise ValueError(f"same_host_window_mb must be in [0, 65536] (0: no shared memory), not {self.same_host_window_mb}")
        self._validate_limits()
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
        if self.pass_thread and self.state_dir:
            raise ValueError("pass_thread is for a node that keeps its state in memory: drop --pass-thread or --state-dir")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError("memory_budget must be positive")
        if not 1 <= self.state_io_threads <= 64:
            raise ValueError(f"state_io_threads must be in [1, 64], not {self.state_io_threads}")
        if self.next_job not in ("take", "refuse"):
            raise ValueError(f"next_job must be 'take' or 'refuse', not {self.next_job!r}")
        if self.non_finite not in ("refuse", "skip"):
            raise ValueError(f"non_finite must be 'refuse' or 'skip', not {self.non_finite!r}")
        if self.non_finite_check not in ("worker", "node"):
            raise ValueError(f"non_finite_check must be 'worker' or 'node', not {self.non_finite_check!r}")
        if self.resume and self.checkpoint_dir and not os.path.isdir(self.checkpoint_dir):
            if os.path.exists(self.checkpoint_dir):
                raise NotADirectoryError(errno.ENOTDIR, "the checkpoint directory to resume from is not a directory", self.checkpoint_dir)
            raise FileNotFoundError(errno.ENOENT, "the checkpoint directory to resume from does not exist", self.checkpoint_dir)
