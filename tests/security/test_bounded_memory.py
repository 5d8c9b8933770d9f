"""A node's memory is bounded whatever its peers send: sizes a HELLO declares are checked before
anything proportional to them is made, HELLOs waiting for rank 0 are bounded in number and bytes,
frames are capped by ZeroMQ itself, payloads by the registered job, peers by --max-peers. Each hostile
pattern runs against a real node process on 127.0.0.1: it gets a clear ERROR (LIMIT or TOO_LARGE
naming the flag, or the error that says what is wrong), the node's RSS grows by at most
``RSS_BOUND_MIB``, and the node then (or meanwhile) trains a small job exactly as torch's AdamW does.
"""

from __future__ import annotations

import logging
import re
import secrets
import socket as socket_module
import struct
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from gpu_worker import RemoteAdamW
from gpu_worker.links.connections import NodeError
from netoptim.launch.processes import NodeProcess
from optimizer_node.config import NodeConfig
from optimizer_node.intake.waiting_hellos import WaitingHellos
from optimizer_node.log_limits import RateLimitedLog
from protos.job.placement import ParamSpec
from protos.job.spec import JobLimits, JobSpec, LimitError
from tests.gpu_worker.harness import RunConfig, max_difference, reference_averaged, run_offloaded
from tests.optimizer_node.raw_client import JOB
from transport.interface import Message
from transport.wire import ErrorCode, Header, MsgType, WireError, encode_header, tensor_header
from transport.zeromq import server as zmq_server
from transport.zeromq.backend import ZmqClient, ZmqTransport
from transport.zeromq.security import generate_keypair, load_keypair

pytestmark = pytest.mark.fresh_nodes  # the nodes' resident memory is measured

RSS_BOUND_MIB = 64
STEPS = 3
BASE = {"world_size": 2, "num_nodes": 1, "bucket_numel": 128, "wire_dtype": "float32", "max_grad_norm": None}


def rss_mib(node: NodeProcess) -> float:
    """The node process's resident set size."""
    assert node.process is not None
    for line in Path(f"/proc/{node.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def hello(rank: int, job: dict, **meta: object) -> Header:
    return Header(msg_type=MsgType.HELLO, rank=rank, meta={"job": job, "node_index": 0, "incarnation": secrets.randbits(62) + 1, **meta})


def ask(client: ZmqClient, header: Header, payload: torch.Tensor | None = None, timeout_s: float = 10.0) -> tuple[Header, float]:
    """Send one message, return the answer and how long it took."""
    started = time.perf_counter()
    client.send(header, payload)
    message = client.recv(timeout_s)
    assert message is not None, f"no answer to {header.msg_type.name} within {timeout_s} s"
    return message.header, time.perf_counter() - started


def assert_refused(reply: Header, code: ErrorCode, *words: str) -> None:
    assert reply.msg_type == MsgType.ERROR, reply
    assert reply.meta["code"] == code, reply.meta
    for word in words:
        assert word in reply.meta["message"], reply.meta["message"]


def train_good_job(address: str, **extra: object) -> None:
    """A two-worker job against the node, bitwise equal to torch's fused AdamW fed the averaged gradients."""
    params, _ = run_offloaded(RunConfig(world_size=2, nodes=[address], steps=STEPS, extra=dict(extra)))
    reference, _ = reference_averaged(2, fused=True, steps=STEPS)
    assert max_difference(params, reference) == 0.0


@pytest.fixture
def raw(start_node):
    """``raw(node)``: a raw ZeroMQ client of ``node``; all are closed at the end."""
    transport = ZmqTransport()
    clients: list[ZmqClient] = []

    def connect(node: NodeProcess) -> ZmqClient:
        clients.append(transport.connect(node.address))
        return clients[-1]

    yield connect
    for client in clients:
        client.close()
    transport.close()


# ---------------------------------------------------------------- declared sizes


HOSTILE_HELLOS = [
    # (what, rank, job, code, words in the answer)
    ("shape of 2^63-1 elements", 0, {**BASE, "params": [["w", [2**63 - 1, 3], "float32", 0]]}, ErrorCode.LIMIT, ["--max-job-elements"]),
    ("2^40 elements in buckets of 128", 0, {**BASE, "params": [["w", [2**40], "float32", 0]]}, ErrorCode.LIMIT, ["--max-job-buckets"]),
    ("2^40 elements, as a rank that would wait", 1, {**BASE, "params": [["w", [2**40], "float32", 0]]}, ErrorCode.LIMIT, ["--max-job-buckets"]),
    ("6.6 TB of state", 0, {**BASE, "bucket_numel": 2**28, "params": [["w", [2**39], "float32", 0]]}, ErrorCode.CANNOT_FIT, ["RAM"]),
    ("a 2 GiB bucket", 0, {**BASE, "bucket_numel": 2**29, "params": [["w", [2**29], "float32", 0]]}, ErrorCode.LIMIT, ["--max-message-bytes"]),
    ("100,000 dimensions", 0, {**BASE, "params": [["w", [2] * 100_000, "float32", 0]]}, ErrorCode.BAD_REQUEST, ["dimensions"]),
    ("a name of 4,000 bytes", 0, {**BASE, "params": [["w" * 4000, [4], "float32", 0]]}, ErrorCode.BAD_REQUEST, ["name"]),
    ("2^62 workers", 0, {**BASE, "world_size": 2**62, "params": [["w", [4], "float32", 0]]}, ErrorCode.LIMIT, ["--max-world-size"]),
    ("2^40 nodes", 0, {**BASE, "num_nodes": 2**40, "params": [["w", [4], "float32", 0]]}, ErrorCode.LIMIT, ["--max-job-nodes"]),
    ("1,001 parameters", 0, {**BASE, "params": [[f"p{i}", [1], "float32", 0] for i in range(1001)]}, ErrorCode.LIMIT, ["--max-job-params"]),
    (
        "a 2 MB header",
        0,
        {**BASE, "params": [[f"p{i}", [1], "float32", 0] for i in range(1000)], "pad": "x" * (2 << 20)},
        ErrorCode.TOO_LARGE,
        ["--max-header-bytes"],
    ),
]


def test_declared_sizes_are_checked_before_anything_is_made(start_node, raw):
    """Each HELLO used to hang the node (a plan of 2^33 buckets, a product of 100,000 dimensions) or
    grow it by GBs; now each is answered at once, and then a good job trains."""
    node = start_node(extra_args=("--max-job-params", "1000", "--no-same-host-ipc"))
    client = raw(node)
    ask(client, Header(msg_type=MsgType.QUERY))  # the node's first answer allocates what every later one reuses
    before = rss_mib(node)
    for what, rank, job, code, words in HOSTILE_HELLOS:
        reply, seconds = ask(client, hello(rank, job))
        assert_refused(reply, code, *words)
        assert seconds < 2.0, f"{what}: answered after {seconds:.1f} s"
    grown = rss_mib(node) - before
    print(f"\ndeclared sizes: node RSS {before:.0f} MiB, +{grown:.1f} MiB after {len(HOSTILE_HELLOS)} hostile HELLOs")
    assert grown <= RSS_BOUND_MIB
    too_many = [torch.nn.Parameter(torch.zeros(2)) for _ in range(1001)]
    with pytest.raises(NodeError, match=r"\(LIMIT\).*1001 parameters.*--max-job-params"):  # what a real worker is told
        RemoteAdamW(too_many, nodes=[node.address], rank=0, world_size=1, timeout_s=10)
    train_good_job(node.address)

    # Registered: no message may declare more than the largest bucket (its frames need not even come).
    client.send_raw([encode_header(Header(msg_type=MsgType.PUSH, rank=0, step=STEPS, bucket_id=0, dtype="float32", numel=1 << 26, num_chunks=1))])
    reply = client.recv(10)
    assert reply is not None
    assert_refused(reply.header, ErrorCode.TOO_LARGE, "largest bucket")
    assert "--max-job-buckets" in node.log_text()


# ---------------------------------------------------------------- HELLOs waiting for rank 0


def test_hellos_with_payloads_are_refused_while_a_job_trains(start_node, raw):
    """1,000 HELLOs of ranks other than 0 carrying 1 MiB each (a GB, which the node used to hold until
    rank 0 came) are refused, while a good job registers and trains beside them."""
    node = start_node(extra_args=("--no-same-host-ipc",))
    client = raw(node)
    ask(client, Header(msg_type=MsgType.QUERY))
    before = rss_mib(node)
    payload = torch.zeros(1 << 18)  # 1 MiB, sent without a copy every time
    count = 1000
    errors: list[BaseException] = []

    def flood() -> None:
        try:
            for _ in range(count):
                client.send(tensor_header(MsgType.HELLO, payload, rank=1, meta=hello(1, JOB.to_wire()).meta), payload)
            for _ in range(count):
                message = client.recv(30)
                assert message is not None, "the node stopped answering"
                # Once the job is registered, a payload over its largest bucket is refused before the HELLO is read.
                refused_as = ErrorCode(message.header.meta["code"])
                assert_refused(message.header, refused_as, "no tensor payload" if refused_as == ErrorCode.BAD_REQUEST else "largest bucket")
                assert refused_as in (ErrorCode.BAD_REQUEST, ErrorCode.TOO_LARGE)
        except BaseException as exc:
            errors.append(exc)

    flood()
    assert not errors, errors
    grown = rss_mib(node) - before
    print(f"\npayload HELLOs: node RSS {before:.0f} MiB, +{grown:.1f} MiB after {count} x 1 MiB HELLOs")
    assert grown <= RSS_BOUND_MIB
    flooder = threading.Thread(target=flood, daemon=True)  # and again, while a job registers and trains
    flooder.start()
    train_good_job(node.address)
    flooder.join(60)
    assert not flooder.is_alive() and not errors, errors


def test_hellos_waiting_for_rank_0_are_bounded(start_node, raw):
    """HELLOs that wait for rank 0 are held up to --max-waiting-hello-bytes (each distinct layout once)
    and --max-waiting-hellos; the others get LIMIT naming the flag; rank 0 then registers and trains."""
    node = start_node(extra_args=("--max-waiting-hellos", "64", "--max-waiting-hello-bytes", "2MiB", "--no-same-host-ipc"))
    client = raw(node)
    ask(client, Header(msg_type=MsgType.QUERY))
    before = rss_mib(node)
    world = {**BASE, "world_size": 1000}
    for rank in range(1, 4):  # distinct layouts of ~0.75 MB each: the third is over 2 MiB
        layout = {**world, "params": [[f"layer{rank}.p{i}", [1], "float32", 0] for i in range(30_000)]}
        reply, _ = ask(client, hello(rank, layout))
        if rank < 3:
            assert reply.msg_type == MsgType.NOTICE and "waits" in reply.meta["waiting_for"], reply
        else:
            assert_refused(reply, ErrorCode.LIMIT, "--max-waiting-hello-bytes")
    held = 2
    same = {**world, "params": [["w", [4], "float32", 0]]}
    for rank in range(100, 100 + 64 - held):  # one small layout shared by all: the count runs out
        reply, _ = ask(client, hello(rank, same))
        assert reply.msg_type == MsgType.NOTICE, reply
    reply, _ = ask(client, hello(999, same))
    assert_refused(reply, ErrorCode.LIMIT, "--max-waiting-hellos")
    for _ in range(200):  # refusals go on as long as the peer likes, and are logged once
        client.send(hello(998, same))
    for _ in range(200):
        message = client.recv(10)
        assert message is not None
        assert_refused(message.header, ErrorCode.LIMIT, "--max-waiting-hellos")
    grown = rss_mib(node) - before
    print(f"\nwaiting HELLOs: node RSS {before:.0f} MiB, +{grown:.1f} MiB with 64 held and 200 refused")
    assert grown <= RSS_BOUND_MIB
    assert node.log_text().count("--max-waiting-hellos") == 1  # one line, however many refusals
    # One worker: a second rank's HELLO could arrive before rank 0's, and the waiting room is full.
    params, _ = run_offloaded(RunConfig(world_size=1, nodes=[node.address], steps=STEPS))
    reference, _ = reference_averaged(1, fused=True, steps=STEPS)
    assert max_difference(params, reference) == 0.0
    # Rank 0 registered: every held HELLO was answered (they describe other jobs).
    answers = [client.recv(10) for _ in range(64)]
    assert all(m is not None and m.header.meta.get("code") == ErrorCode.LAYOUT_MISMATCH for m in answers)


# ---------------------------------------------------------------- frames and peers


def raw_dealer(context: zmq.Context, address: str, **options: object) -> tuple[zmq.Socket, zmq.Socket]:
    """A bare DEALER (with ``options`` set) and a monitor of its disconnections."""
    socket = context.socket(zmq.DEALER)
    for option, value in options.items():
        socket.setsockopt(getattr(zmq, option), value)
    socket.setsockopt(zmq.LINGER, 0)
    monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    socket.connect(address)
    return socket, monitor


def wait_for_event(monitor: zmq.Socket, event: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if monitor.poll(int(left * 1000)) and recv_monitor_message(monitor)["event"] == event:
            return True
    return False


def test_a_frame_over_the_cap_disconnects_the_peer(start_node, raw):
    """Without CURVE, a frame over the cap (4 MiB by default: the largest frame the protocol sends) gets
    its sender disconnected by ZeroMQ before the frame is stored: 20 x 16 MiB leave the node as it was."""
    node = start_node(extra_args=("--no-same-host-ipc",))
    client = raw(node)
    ask(client, Header(msg_type=MsgType.QUERY))
    before = rss_mib(node)
    context = zmq.Context()
    big = bytes(16 << 20)
    header = encode_header(Header(msg_type=MsgType.ECHO, dtype="float32", numel=len(big) // 4, num_chunks=1))
    try:
        for _ in range(20):
            socket, monitor = raw_dealer(context, node.address)
            assert wait_for_event(monitor, zmq.EVENT_CONNECTED)
            socket.send_multipart([header, big], copy=False)
            assert wait_for_event(monitor, zmq.EVENT_DISCONNECTED), "the node kept a peer that sent a frame over the cap"
            assert not socket.poll(0)  # and did not answer it
            socket.disable_monitor()
            monitor.close()
            socket.close()
    finally:
        context.term()
    grown = rss_mib(node) - before
    print(f"\nframes over the cap: node RSS {before:.0f} MiB, +{grown:.1f} MiB after 20 x 16 MiB frames")
    assert grown <= RSS_BOUND_MIB
    reply, _ = ask(client, Header(msg_type=MsgType.QUERY))  # the other peers are served as before
    assert reply.msg_type == MsgType.STATUS
    train_good_job(node.address)


@pytest.fixture(scope="module")
def curve_keys(tmp_path_factory):
    """The node's key pair and a worker key pair in an allow-list (any rank)."""
    root = tmp_path_factory.mktemp("bounded-curve")
    keys, allowed = root / "keys", root / "allowed"
    generate_keypair(str(keys), "node")
    generate_keypair(str(keys), "good")
    allowed.mkdir()
    (allowed / "good.key").write_bytes((keys / "good.key").read_bytes())
    return keys, allowed


class RawZmtp:
    """A peer that speaks ZMTP 3.0 by hand over TCP. A libzmq client queues a multipart message until
    its last frame; a hostile peer does not have to: it can send frames that say more follow, forever."""

    def __init__(self, address: str, mechanism: bytes) -> None:
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        self.socket = socket_module.create_connection((host, int(port)), timeout=10)
        # signature, version 3.0, mechanism, as-server 0, filler
        self.socket.sendall(b"\xff" + bytes(7) + b"\x01\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0") + bytes(32))
        if mechanism == b"NULL":  # READY, as a DEALER: from here on, frames
            body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
            self.socket.sendall(b"\x04" + bytes([len(body)]) + body)

    def send_more_frames(self, total_bytes: int, frame_bytes: int = 1 << 20) -> int:
        """Frames of ``frame_bytes`` (under the frame cap), each saying more follow; returns the bytes
        the node took before it closed the connection."""
        frame = bytes(frame_bytes)
        sent = 0
        try:
            while sent < total_bytes:
                self.socket.sendall(b"\x03" + struct.pack(">Q", frame_bytes))  # MORE | LONG, 64-bit size
                self.socket.sendall(frame)
                sent += frame_bytes
        except OSError:  # reset by the node
            pass
        return sent

    def close(self) -> None:
        self.socket.close()


def test_without_curve_unfinished_messages_do_not_stop_the_node(start_node, raw):
    """The known limitation (docs/operations.md, Limits): without authentication, ZeroMQ holds the
    frames of a message until its last one, and nothing bounds how many come (measured: 64 MiB of MORE
    frames grow the node by as much until the peer goes). What holds: the node serves everyone
    meanwhile and after."""
    node = start_node(extra_args=("--no-same-host-ipc",))
    client = raw(node)
    ask(client, Header(msg_type=MsgType.QUERY))
    before = rss_mib(node)
    peer = RawZmtp(node.address, b"NULL")
    try:
        sent = peer.send_more_frames(64 << 20)
        print(f"\nMORE frames, no CURVE: node RSS {before:.0f} MiB, +{rss_mib(node) - before:.1f} MiB after {sent >> 20} MiB of pending MORE frames")
        assert ask(client, Header(msg_type=MsgType.QUERY))[0].msg_type == MsgType.STATUS
    finally:
        peer.close()
    train_good_job(node.address)


def test_with_curve_a_key_not_allowed_sends_no_frame(start_node, curve_keys):
    """With CURVE a peer needs an allowed key to send a single frame: a libzmq client with another key
    fails the handshake, and a peer that skips the handshake to send 256 MiB of MORE frames is cut off
    at once. The node's memory stays as it was, and an allowed worker trains meanwhile."""
    keys, allowed = curve_keys
    node = start_node(extra_args=("--curve-secret-key", str(keys / "node.key_secret"), "--curve-allow", str(allowed), "--no-same-host-ipc"))
    server_key, _ = load_keypair(str(keys / "node.key"), need_secret=False)
    stranger_public, stranger_secret = zmq.curve_keypair()
    context = zmq.Context()
    socket, monitor = raw_dealer(context, node.address, CURVE_SERVERKEY=server_key, CURVE_PUBLICKEY=stranger_public, CURVE_SECRETKEY=stranger_secret)
    try:
        assert wait_for_event(monitor, zmq.EVENT_HANDSHAKE_FAILED_AUTH), "the node let a key it does not allow through the handshake"
        before = rss_mib(node)
        taken = {}
        for mechanism in (b"CURVE", b"NULL"):  # frames instead of the CURVE handshake; a mechanism the node does not speak
            peer = RawZmtp(node.address, mechanism)
            taken[mechanism] = peer.send_more_frames(256 << 20)
            peer.close()
        grown = rss_mib(node) - before
        print(f"\nMORE frames, key not allowed: node RSS {before:.0f} MiB, +{grown:.1f} MiB; bytes the node took before it hung up: {taken}")
        assert grown <= RSS_BOUND_MIB
        assert all(sent < 256 << 20 for sent in taken.values())  # cut off: the kernel's socket buffers took the rest
        train_good_job(node.address, curve_secret_key=str(keys / "good.key_secret"), curve_server_key=str(keys / "node.key"))
    finally:
        socket.disable_monitor()
        monitor.close()
        socket.close(linger=0)
        context.term()


def test_peers_are_bounded(start_node, raw):
    """A node keeps track of at most --max-peers peers (a laned client is one): a new one beyond them is
    answered LIMIT naming the flag, and the peers it knows are served as before."""
    node = start_node(extra_args=("--max-peers", "8", "--no-same-host-ipc"))
    strangers = [raw(node) for _ in range(5)]
    laned_transport = ZmqTransport(connections_per_peer=3)
    laned = laned_transport.connect(node.address)
    try:
        for client in [*strangers, laned]:
            assert ask(client, Header(msg_type=MsgType.QUERY))[0].msg_type == MsgType.STATUS
        laned.send(Header(msg_type=MsgType.QUERY, bucket_id=2))  # another lane of the same peer
        assert laned.recv(10) is not None
        train_good_job(node.address)  # two more peers: eight
        late = raw(node)
        reply, _ = ask(late, Header(msg_type=MsgType.QUERY))
        assert_refused(reply, ErrorCode.LIMIT, "--max-peers")
        assert ask(strangers[0], Header(msg_type=MsgType.QUERY))[0].msg_type == MsgType.STATUS
    finally:
        laned.close()
        laned_transport.close()


def rejected_messages(node: NodeProcess) -> float:
    """The node's count of messages answered with an error (its Prometheus metrics)."""
    with urllib.request.urlopen(node.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return float(re.search(r"^netoptim_rejected_messages_total (\S+)$", text, re.MULTILINE).group(1))  # type: ignore[union-attr]


def _never_reading(node: NodeProcess) -> tuple[zmq.Context, zmq.Socket]:
    """A DEALER that reads nothing: its own queue and kernel buffer hold one answer, so whatever else
    the node answers stays with the node."""
    context = zmq.Context()
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.RCVHWM, 1)
    peer.setsockopt(zmq.RCVBUF, 4096)
    peer.setsockopt(zmq.SNDHWM, 0)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(node.address)
    return context, peer


def test_answers_that_are_never_read_are_bounded(start_node, raw):
    """A peer outside the job that sends ECHOs of 1 MiB (sent back without a copy) and requests that
    are answered with small ERRORs, and never reads: the node holds at most --max-echo-bytes of echoes
    and --max-unread-reply-bytes of other answers for it (more was pinned before: 256 MiB of echoes,
    and answers without a limit), serves everyone else meanwhile, and a good job trains bitwise."""
    node = start_node(extra_args=("--no-same-host-ipc", "--metrics-port", "0"))
    client = raw(node)
    ask(client, Header(msg_type=MsgType.QUERY))
    context, peer = _never_reading(node)
    payload = torch.zeros(1 << 18)  # 1 MiB
    echo_frames = [encode_header(tensor_header(MsgType.ECHO, payload)), memoryview(payload.numpy()).cast("B")]
    pull_frame = encode_header(Header(msg_type=MsgType.PULL, rank=3, bucket_id=0, meta={"at_step": 0}))
    before = rss_mib(node)
    try:
        for round_ in range(4):  # 200 MiB of echoes and 40,000 requests, nothing read
            for _ in range(50):
                peer.send_multipart(echo_frames, copy=False)
            for _ in range(10_000):
                peer.send(pull_frame)
            assert ask(client, Header(msg_type=MsgType.QUERY))[0].msg_type == MsgType.STATUS, f"round {round_}"
        deadline = time.monotonic() + 60  # the node reads the peer at its own pace (ZeroMQ holds the rest back at the peer)
        while rejected_messages(node) < 40_000 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rejected_messages(node) >= 40_000, "the node did not get through the requests in 60 s"
        grown = rss_mib(node) - before  # before the job: its compiled update loads ~140 MB of its own
        print(f"\nunread answers: node RSS {before:.0f} MiB, +{grown:.1f} MiB after 200 MiB of echoes and 40,000 requests never read")
        assert grown <= RSS_BOUND_MIB
        assert "--max-unread-reply-bytes" in node.log_text()
        train_good_job(node.address)  # the peer is still there, its answers unread
    finally:
        peer.close()
        context.term()


def test_a_silent_peer_makes_room(monkeypatch):
    """Peers silent for PEER_IDLE_S are forgotten when a new one needs the room (in process)."""
    transport = ZmqTransport(max_peers=2)
    server = transport.bind("tcp://127.0.0.1:0")
    clients = [transport.connect(server.address) for _ in range(3)]
    try:
        for client in clients[:2]:
            client.send(Header(msg_type=MsgType.QUERY))
            assert server.recv(5) is not None
        clients[2].send(Header(msg_type=MsgType.QUERY))
        with pytest.raises(WireError, match="--max-peers") as refused:
            server.recv(5)
        assert refused.value.code == ErrorCode.LIMIT and refused.value.peer is not None
        monkeypatch.setattr(zmq_server, "PEER_IDLE_S", 0.0)
        clients[2].send(Header(msg_type=MsgType.QUERY))
        assert server.recv(5) is not None
    finally:
        for client in clients:
            client.close()
        server.close()
        transport.close()


# ---------------------------------------------------------------- the pieces


def test_job_limits_cost_nothing_proportional_to_declared_sizes():
    limits = JobLimits()
    huge = JobSpec(2, 1, 64, "float32", None, (ParamSpec("w", (2**62,) * 64, "float32", 0),))
    started = time.perf_counter()
    with pytest.raises(LimitError, match="--max-job-elements"):
        huge.check_limits(limits)
    assert time.perf_counter() - started < 0.1
    with pytest.raises(ValueError, match="duplicate parameter name"):
        JobSpec(2, 1, 64, "float32", None, (ParamSpec("w", (4,), "float32", 0),) * 2).check_limits(limits)
    many = [["p", [1], "float32", 0]] * 10
    with pytest.raises(LimitError, match="--max-job-params"):
        JobSpec.from_wire({**BASE, "params": many}, JobLimits(max_params=9))
    JOB.check_limits(limits)
    assert JOB.plan_within(limits) == JOB.plan()


def test_waiting_hellos_hold_each_layout_once():
    room = WaitingHellos(max_count=3, max_bytes=10_000)
    job = {**BASE, "params": [["w", [4], "float32", 0]]}
    for rank in (1, 2):
        room.hold(Message(peer=b"p", header=hello(rank, job), tensors=[]))
    shared = room.held_bytes
    room.hold(Message(peer=b"p", header=hello(2, job), tensors=[]))  # the same peer and rank again: replaced
    assert len(room) == 2 and room.held_bytes == shared
    with pytest.raises(LimitError, match="--max-waiting-hello-bytes"):
        room.hold(Message(peer=b"q", header=hello(3, {**job, "pad": "x" * 10_000}), tensors=[]))
    room.hold(Message(peer=b"q", header=hello(3, job), tensors=[]))
    with pytest.raises(LimitError, match="--max-waiting-hellos"):
        room.hold(Message(peer=b"r", header=hello(4, job), tensors=[]))
    restored = room.take_all()
    assert [m.header.rank for m in restored] == [1, 2, 3] and all(m.header.meta["job"] == job for m in restored)
    assert len(room) == 0 and room.held_bytes == 0


def test_rate_limited_log_counts_what_it_leaves_out(caplog):
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("bounded"), interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="bounded"):
        assert limited.log("a", logging.WARNING, "over %s", "--max-peers")
        for _ in range(5):
            assert not limited.log("a", logging.WARNING, "over %s", "--max-peers")
        assert limited.log("b", logging.WARNING, "another limit")  # its own key
        now[0] = 10.0
        assert limited.log("a", logging.WARNING, "over %s", "--max-peers")
    lines = [record.getMessage() for record in caplog.records]
    assert lines == ["over --max-peers", "another limit", "over --max-peers (and 5 more like it in the last 10 s, not logged)"]


def test_limit_settings_are_validated():
    with pytest.raises(ValueError, match="max_frame_bytes"):
        NodeConfig(max_frame_bytes=1 << 20).validate()
    with pytest.raises(ValueError, match="max_header_bytes"):
        NodeConfig(max_header_bytes=32 << 20).validate()
    with pytest.raises(ValueError, match="max_peers"):
        NodeConfig(max_peers=0).validate()
    with pytest.raises(ValueError, match="max_buckets"):
        NodeConfig(max_job_buckets=0).validate()
    assert NodeConfig().frame_limit_bytes == 4 << 20
    assert NodeConfig(max_header_bytes=8 << 20).frame_limit_bytes == 8 << 20
