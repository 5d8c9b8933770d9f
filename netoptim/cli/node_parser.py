"""``netoptim node``'s flags: the argparse definition of each, with its help and default, the
resource limits in a group of their own. :mod:`netoptim.cli.node_configs` turns them into the node's
configs; nothing here imports the node, so that ``--help`` stays fast."""

from __future__ import annotations

import argparse

from netoptim.cli.admin import TOKEN_ENV
from netoptim.cli.arg_types import address, niceness, non_negative_int, port_number, positive_int, size
from netoptim.launch.thread_wait import WAIT_CHOICES


def add_node_parser(subparsers: argparse._SubParsersAction) -> None:
    node = subparsers.add_parser(
        "node",
        help="run an optimizer-node daemon",
        description="Run an optimizer node: it holds the fp32 master parameters and AdamW state of the buckets it owns, sums the workers' gradients, applies the update and sends the new parameters back. Stops cleanly on SIGTERM or SIGINT.",
    )
    node.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="read flags from the [node] table of this TOML file (keys are the flags' long names, e.g. checkpoint-every = 500); flags given here override it",
    )
    node.add_argument(
        "--print-config", action="store_true", help="print every setting with where it came from (default, config file line, command line) and exit"
    )
    node.add_argument(
        "--listen",
        type=address,
        default="tcp://127.0.0.1:0",
        help="data-plane address to bind, tcp://HOST:PORT, ipc://PATH, mooncake://HOST:PORT or mooncake+rdma://HOST:PORT; port 0 lets the OS choose; the node refuses to start when another process holds it (default: %(default)s)",
    )
    node.add_argument(
        "--no-same-host-ipc",
        dest="same_host_ipc",
        action="store_false",
        help="do not also listen on an ipc:// socket in the temporary directory (by default workers on this host switch to it after their HELLO: no TCP stack)",
    )
    node.add_argument(
        "--same-host-board",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep a read-only board of the parameters sent (the wire dtype; each bucket's version and the one before) that every "
        "worker on this host with shared windows installs from, written once per step, instead of a copy into each worker's window "
        "at each fetch; costs two copies of this node's share in the wire dtype in RAM (skipped where the host's available memory cannot hold them). Out of core "
        "(--state-dir) only when given: then workers install straight from it and fetches of buckets not in memory read no file "
        "(default: on in memory, off out of core)",
    )
    node.add_argument(
        "--masters-on-board",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fp32 in memory with a board: keep the master values on the board's two slots, each update reading one and writing the "
        "other (no value written twice, no copy of the masters of its own); --no-masters-on-board updates them in place and copies "
        "the new values onto the board, for comparison (default: on)",
    )
    node.add_argument(
        "--same-host-window-mb",
        type=int,
        default=64,
        metavar="MIB",
        help="shared memory each worker on the same-host socket gets for its payloads, each way: gradients and parameters are copied "
        "into it once instead of through the kernel (pages are allocated as first written; a full window sends on the socket); "
        "0 keeps payloads on the socket (default: %(default)s)",
    )
    node.add_argument(
        "--same-host-gradient-window",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give each worker on the same-host socket a window for its gradients that holds a whole step of what it pushes here "
        "(this node's share of the job's gradients, wire dtype; pages allocated as first written): it gathers them straight into "
        "shared memory, on a GPU with one device-to-host copy, and this node reads them there (with --same-host-window-mb to spare); "
        "off: that window is --same-host-window-mb and what does not fit goes on the socket (default: on)",
    )
    node.add_argument(
        "--ready-file",
        help='write {"data": ADDRESS, "pid": PID, "node_id": ID} here as JSON once the node accepts work, with "same_host", "admin" and "metrics" when it serves them',
    )
    node.add_argument("--node-id", default="", help="a name for this node in logs (default: its address)")
    node.add_argument("--chunk-bytes", type=size, default=None, help="size of the frames outgoing tensors are split into (default: 4MiB)")
    add_limit_flags(node)
    node.add_argument(
        "--io-threads",
        type=positive_int,
        default=1,
        help="I/O threads moving the data plane's bytes; give the connections per node your workers open (default: %(default)s)",
    )
    node.add_argument(
        "--huge-pages",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the node's tensors of 2 MiB and more (its state, the update pass's buffers) in transparent huge pages where the "
        "host grants them on advice (/sys/kernel/mm/transparent_hugepage/enabled: madvise or always): the update pass streams "
        "them with far fewer TLB misses (7%% faster in bench optimizer); THP_MEM_ALLOC_ENABLE in the environment, where set, "
        "decides instead (default: on)",
    )
    node.add_argument(
        "--pass-thread",
        action="store_true",
        help="run the update passes on a thread of their own, so the node receives gradients and sends new values while a pass runs "
        "(with --cpus/--numa-node, one more CPU is left to the serve loop); not with --state-dir (default: passes on the serve loop's thread)",
    )
    node.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="CPU threads for the update kernels (default: one per CPU of --cpus/--numa-node, but one left for the node's "
        "I/O from 4 CPUs up, two with --pass-thread, and with --state-dir one more for each of the store's 2 x --state-io-threads "
        "readers and writers while the passes keep half the CPUs; otherwise torch's choice)",
    )
    node.add_argument(
        "--update-threads-wait",
        choices=WAIT_CHOICES,
        default="auto",
        help="what the update threads do between passes: sleep (the CPU goes to whatever else runs on it; a pass wakes them) or "
        "spin (ready at once, each keeping its CPU busy 10-20 ms after every pass); auto: spin on CPUs of the node's own "
        "(--cpus/--numa-node, in memory), sleep on CPUs they share with workers or, with --state-dir, with the store's I/O "
        "threads, unless OMP_WAIT_POLICY is set (default: %(default)s)",
    )
    node.add_argument(
        "--nice",
        type=niceness,
        default=0,
        metavar="N",
        help="CPU niceness of the node, -20 (most CPU) to 19 (least): on cores it shares with CPU workers, 10 keeps its updates "
        "from landing on whichever worker is behind (2 workers on 2 cores: 5-6%% more tokens/s); below the current one needs root "
        "(default: %(default)s)",
    )
    node.add_argument(
        "--cpus",
        default=None,
        metavar="LIST",
        help="run on these CPUs only, e.g. 0-13 or 2-7,10: leave the cores a GPU worker's process needs to it, or give each node of "
        "a host its own (default: every CPU this process may use)",
    )
    node.add_argument(
        "--numa-node",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="run on NUMA node N's CPUs only, so that the state, first written by them, is in that node's memory; run one node per "
        "NUMA node on hosts with several (default: no pinning; not with --cpus)",
    )
    node.add_argument(
        "--checkpoint-dir", default=None, help="directory for crash-safe checkpoints (one subdirectory per checkpoint); without it none are taken"
    )
    node.add_argument(
        "--checkpoint-every",
        type=non_negative_int,
        default=0,
        help="checkpoint every N steps; 0: only on request, on drain and on SIGTERM (default: %(default)s)",
    )
    node.add_argument(
        "--keep",
        type=positive_int,
        default=3,
        help="automatic checkpoints (periodic, at exit) to keep; older ones are removed; those taken by hand (admin checkpoint, drain) are never removed (default: %(default)s)",
    )
    node.add_argument(
        "--resume",
        action="store_true",
        help="start from the newest intact checkpoint in --checkpoint-dir (damaged ones are skipped); workers that reconnect continue from its step. A directory that does not exist is an error (exit 1); an empty one starts fresh with a warning",
    )
    node.add_argument(
        "--curve-secret-key",
        default=None,
        metavar="FILE",
        help="the node's CURVE .key_secret file (netoptim keygen): encrypt the data plane and admit only allowed workers",
    )
    node.add_argument(
        "--curve-allow", default=None, metavar="DIR", help="directory of the .key files of the workers allowed to connect (with --curve-secret-key)"
    )
    node.add_argument(
        "--insecure",
        action="store_true",
        help="allow --listen on an address reachable from other hosts without CURVE (only on a trusted, isolated network: anyone who reaches the port can read and change the model); without it such a node refuses to start",
    )
    node.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="out-of-core mode: keep parameters and AdamW state in files here (scratch space, cleared at start; put it on a fast local disk, on the checkpoint directory's filesystem so checkpoints are hard links)",
    )
    node.add_argument(
        "--memory-budget", type=size, default=None, metavar="SIZE", help="out-of-core mode: at most this much state in memory, e.g. 4GiB (with --state-dir)"
    )
    node.add_argument(
        "--sync-state-writes",
        action="store_true",
        help="out-of-core mode: fdatasync every state write and drop it from the page cache (bounded page cache, disk-speed updates)",
    )
    node.add_argument(
        "--state-io-threads",
        type=int,
        default=2,
        metavar="N",
        help="out-of-core mode: threads that read state files, and as many that write them; each copies and checksums its file, so "
        "where the page cache or a fast disk serves the state their CPU bounds the node: give more on a host with cores to spare "
        "(default: %(default)s)",
    )
    node.add_argument(
        "--non-finite",
        choices=("refuse", "skip"),
        default="refuse",
        help="what to do with a gradient holding NaN or inf, found before it touches any state. refuse: answer that push with an error naming "
        "the rank, bucket and step, keep the bucket's state and the other ranks' gradients (the worker's step() raises; it may push that bucket "
        "again with finite values). skip: skip the whole step on every bucket of every node, as torch's GradScaler does for mixed precision "
        "(parameters, moments and AdamW's step count unchanged, the workers get the unchanged parameters and go on; costs a global agreement "
        "per step, as clipping does). Give every node of a job the same policy (default: %(default)s)",
    )
    node.add_argument(
        "--non-finite-check",
        choices=("worker", "node"),
        default="worker",
        help="who checks a push for NaN/inf. worker: take a worker's word that its gradient is finite (a GPU worker sums each bucket on the "
        "device before copying it out, nearly free there; pushes without that word, as from CPU workers, are checked here). node: check "
        "every push here (one more read of every gradient on this host's memory bus) (default: %(default)s)",
    )
    node.add_argument(
        "--next-job",
        choices=("take", "refuse"),
        default="take",
        help="once every rank of the job has closed its optimizer (the job is finished): take: let the job go (its last state checkpointed, its "
        "checkpoints moved to finished/ under --checkpoint-dir) as soon as rank 0 of another job says HELLO; refuse: keep the finished job "
        "(HELLOs of another job are refused) until `netoptim admin reset` (default: %(default)s)",
    )
    node.add_argument(
        "--crash-at", metavar="POINT:N", default=None, help="testing only: exit abruptly the N-th time the node passes POINT (push, update or checkpoint)"
    )
    node.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        help='serve Prometheus metrics at http://HOST:PORT/metrics (0: the OS picks; the URL goes into the ready file as "metrics")',
    )
    node.add_argument("--metrics-host", default="127.0.0.1", help="interface for --metrics-port (default: %(default)s)")
    node.add_argument(
        "--admin",
        metavar="HOST:PORT",
        default=None,
        help='serve the gRPC admin service here (port 0: the OS picks; the address goes into the ready file as "admin"); bind to 127.0.0.1 unless the network is trusted or a token is set',
    )
    node.add_argument("--tls-cert", default=None, help="PEM certificate for the admin service; with --tls-key it speaks TLS only")
    node.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    node.add_argument(
        "--admin-token-file",
        default=None,
        metavar="FILE",
        help=f"require 'authorization: Bearer TOKEN' on admin calls (health checks excepted), the token read from FILE (mode 600); or set ${TOKEN_ENV}",
    )
    node.add_argument(
        "--admin-token",
        default=None,
        help=f"the admin token on the command line: works, but every user of the host sees it in ps; prefer --admin-token-file or ${TOKEN_ENV}",
    )


LIMIT_FLAGS = (
    "max_message_bytes",
    "max_frame_bytes",
    "max_header_bytes",
    "max_peers",
    "max_job_params",
    "max_job_elements",
    "max_job_buckets",
    "max_world_size",
    "max_job_nodes",
    "max_waiting_hellos",
    "max_waiting_hello_bytes",
    "max_unread_reply_bytes",
    "max_echo_bytes",
)
"""The node's resource limits: flags of the same name as their NodeConfig field (docs/operations.md, Limits)."""


def add_limit_flags(node: argparse.ArgumentParser) -> None:
    """The flags of the limits that keep a node's memory bounded whatever its peers send (defaults in
    :class:`~optimizer_node.NodeConfig`, repeated here: importing it would make --help slow)."""
    limits = node.add_argument_group(
        "limits",
        "What any peer that reaches the data plane can make the node hold is bounded by these. A message over one is answered with ERROR "
        "(LIMIT or TOO_LARGE, naming the flag) and logged at most once per limit every 10 s; see docs/operations.md, Limits.",
    )
    limits.add_argument(
        "--max-message-bytes",
        type=size,
        metavar="SIZE",
        default=None,
        help="largest tensor payload in one message (TOO_LARGE); once a job is registered, its largest bucket as fp32 if that is less; "
        "a job with a larger bucket is refused (default: 1GiB)",
    )
    limits.add_argument(
        "--max-frame-bytes",
        type=size,
        metavar="SIZE",
        default=None,
        help="largest ZeroMQ frame: a peer that sends a larger one is disconnected by ZeroMQ before it is stored, without an answer "
        "(default and minimum: the largest of --chunk-bytes, 4MiB and --max-header-bytes)",
    )
    limits.add_argument(
        "--max-header-bytes",
        type=size,
        metavar="SIZE",
        default=None,
        help="largest message header (TOO_LARGE); a HELLO lists every parameter, ~60-100 bytes each; decoding a header can take ~70x its size "
        "for a moment (default: 1MiB, at most 16MiB)",
    )
    limits.add_argument(
        "--max-peers",
        type=positive_int,
        metavar="N",
        default=None,
        help="distinct peers (worker connections) the node keeps track of; a new one beyond is refused with LIMIT unless the least recently "
        "heard one has been silent for 5 minutes (default: 65536)",
    )
    limits.add_argument("--max-job-params", type=positive_int, metavar="N", default=None, help="parameters a job may declare in its HELLO (default: 131072)")
    limits.add_argument(
        "--max-job-elements",
        type=positive_int,
        metavar="N",
        default=None,
        help="elements a job may declare, all parameters together; its share must also fit the node's memory or --state-dir (default: 2^40)",
    )
    limits.add_argument(
        "--max-job-buckets",
        type=positive_int,
        metavar="N",
        default=None,
        help="buckets a job may have; planning costs every node ~0.4 KB and ~10 us per bucket (default: 131072)",
    )
    limits.add_argument("--max-world-size", type=positive_int, metavar="N", default=None, help="workers a job may declare (default: 16384)")
    limits.add_argument("--max-job-nodes", type=positive_int, metavar="N", default=None, help="optimizer nodes a job may declare (default: 4096)")
    limits.add_argument(
        "--max-waiting-hellos",
        type=positive_int,
        metavar="N",
        default=None,
        help="HELLOs of ranks other than 0 held until rank 0 registers the job; give at least the job's world size (default: 4096)",
    )
    limits.add_argument(
        "--max-waiting-hello-bytes",
        type=size,
        metavar="SIZE",
        default=None,
        help="bytes those held HELLOs may take: each distinct layout once, as encoded, plus ~0.5 KB per HELLO (default: 16MiB)",
    )
    limits.add_argument(
        "--max-unread-reply-bytes",
        type=size,
        metavar="SIZE",
        default=None,
        help="bytes of answers to peers outside the job (not registered as a rank) waiting in the node's send queue, one peer at most a 16th; "
        "answers beyond are dropped, so a peer that never reads cannot grow the node (default: 16MiB)",
    )
    limits.add_argument(
        "--max-echo-bytes",
        type=size,
        metavar="SIZE",
        default=None,
        help="ECHO payloads (transport benchmarks) on their way back at once; an ECHO beyond is answered with LIMIT (default: 16MiB)",
    )
