"""Who may register as what, and what a peer that is not a registered rank learns.

With CURVE, a worker key made with ``netoptim keygen --ranks`` registers as those ranks only
(FORBIDDEN otherwise, naming the key); a registered rank is its connection and its key together, so
another key cannot take over its routing id; and a peer that is not a registered rank gets no
layout and no state in any reply. Real nodes on 127.0.0.1 with CURVE on, driven by raw ZeroMQ peers
(which can send exactly what a test means) and once by ``RemoteAdamW``.
"""

from __future__ import annotations

import logging
import secrets

import pytest
import torch
import zmq

from gpu_worker import RemoteAdamW
from netoptim.console import main as netoptim_main
from optimizer_node.config import NodeConfig
from optimizer_node.daemon import NodeDaemon
from protos.job.placement import ParamSpec
from protos.job.spec import JobSpec
from transport.interface import Message, SendHandle
from transport.payload_views import payload_views
from transport.wire import ErrorCode, Header, MsgType, decode_header, encode_message, tensor_header
from transport.zeromq.security import AllowList, CurveClientConfig, CurveServerConfig, parse_ranks, read_metadata, secure_client_socket

# Names and a shape no reply to a peer that is not a registered rank may contain.
SECRET_NAMES = ("encoder.secret_kernel", "decoder.hidden_bias")
JOB = JobSpec(
    world_size=2,
    num_nodes=2,
    bucket_numel=128,
    wire_dtype="float32",
    max_grad_norm=None,
    params=(ParamSpec(SECRET_NAMES[0], (200,), "float32", 0), ParamSpec(SECRET_NAMES[1], (10,), "float32", 0)),
)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """The node's key pair, and worker keys in an allow-list: ``w0`` (rank 0), ``w01`` (ranks 0-1),
    ``w1`` (rank 1) and ``free`` (no ranks), made with ``netoptim keygen`` in this process."""
    root = tmp_path_factory.mktemp("identity")
    keys, allowed = root / "keys", root / "allowed"
    for name, ranks in (("node", None), ("w0", "0"), ("w01", "0-1"), ("w1", "1"), ("free", None)):
        assert netoptim_main(["keygen", name, "--dir", str(keys), *(["--ranks", ranks] if ranks else [])]) == 0
    allowed.mkdir()
    for name in ("w0", "w01", "w1", "free"):
        (allowed / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    return keys, allowed


def start_curve_node(start_node, keys):
    key_dir, allowed = keys
    return start_node(extra_args=("--curve-secret-key", str(key_dir / "node.key_secret"), "--curve-allow", str(allowed)))


class Peer:
    """A raw DEALER with a worker's CURVE key, speaking the protocol message by message."""

    def __init__(self, context: zmq.Context, address: str, keys, name: str, routing_id: bytes | None = None) -> None:
        key_dir, _ = keys
        self.name = name
        self.routing_id = routing_id or b"\x02" + secrets.token_bytes(7)
        self.socket = context.socket(zmq.DEALER)
        secure_client_socket(self.socket, CurveClientConfig(str(key_dir / f"{name}.key_secret"), str(key_dir / "node.key")))
        self.socket.setsockopt(zmq.ROUTING_ID, self.routing_id)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.incarnation = secrets.randbits(62) | 1

    def send(self, header: Header, payload: torch.Tensor | None = None) -> None:
        self.socket.send_multipart(encode_message(header, payload))

    def reply(self, timeout_s: float = 10.0) -> tuple[Header, torch.Tensor | None]:
        assert self.socket.poll(int(timeout_s * 1000)), f"the node did not answer {self.name}"
        frames = self.socket.recv_multipart()
        header = decode_header(frames[0])
        views = payload_views(header, [memoryview(frame) for frame in frames[1:]], max_bytes=1 << 30)
        return header, (torch.cat([view for _, view in views]).clone() if views else None)

    def request(self, header: Header, payload: torch.Tensor | None = None) -> Header:
        self.send(header, payload)
        return self.reply()[0]

    def hello(self, rank: int, job: JobSpec = JOB, node_index: int = 0) -> Header:
        meta = {"job": job.to_wire(), "node_index": node_index, "incarnation": self.incarnation}
        return self.request(Header(msg_type=MsgType.HELLO, rank=rank, meta=meta))

    def close(self) -> None:
        self.socket.close(linger=0)


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def fingerprint(keys, name: str) -> str:
    return AllowList.load(keys[1]).grant(load_z85(keys, name)).fingerprint


def load_z85(keys, name: str) -> str:
    import zmq.auth

    public, _ = zmq.auth.load_certificate(str(keys[0] / f"{name}.key"))
    return public.decode("ascii")


def assert_error(header: Header, code: ErrorCode, *words: str) -> str:
    assert header.msg_type == MsgType.ERROR, header
    assert header.meta["code"] == code, header.meta
    for word in words:
        assert word in header.meta["message"], header.meta["message"]
    return header.meta["message"]


def assert_reveals_nothing(header: Header) -> None:
    """No name, shape or bucket layout of the registered job in a reply."""
    text = repr(header.meta)
    for secret in (*SECRET_NAMES, "[200]", "(200,)", "owned", "needs_init", "missing", "connected_ranks"):
        assert secret not in text, f"{secret!r} leaked in {header.msg_type.name}: {text}"


def register_rank0(peer: Peer) -> list[int]:
    """Rank 0 registers JOB and sends its initial values; returns the buckets this node owns."""
    reply = peer.hello(0)
    assert reply.msg_type == MsgType.HELLO_OK, reply
    for bucket in (b for b in JOB.plan() if b.bucket_id in reply.meta["needs_init"]):
        values = torch.full((bucket.numel,), 0.5)
        assert peer.request(tensor_header(MsgType.INIT, values, rank=0, bucket_id=bucket.bucket_id), values).msg_type == MsgType.ACK
    return reply.meta["owned"]


def test_keygen_writes_the_ranks_into_both_files(keys):
    key_dir, allowed = keys
    assert read_metadata(key_dir / "w01.key") == {"ranks": "0-1"} == read_metadata(key_dir / "w01.key_secret")
    assert read_metadata(key_dir / "free.key") == {}
    assert parse_ranks("3, 0-1,2,7") == ((0, 3), (7, 7))
    for bad in ("", "a", "3-1", "-1", "1,,2"):
        with pytest.raises(ValueError, match="ranks"):
            parse_ranks(bad)
    assert netoptim_main(["keygen", "bad", "--dir", str(key_dir), "--ranks", "0,1"]) == 0  # the --name spelling still works too
    assert netoptim_main(["keygen", "--name", "also", "--dir", str(key_dir)]) == 0
    assert len(AllowList.load(allowed)) == 4


def test_a_bad_allow_list_stops_the_node_at_start(tmp_path, keys):
    key_dir, _ = keys
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    text = (key_dir / "w0.key").read_text()
    (allowed / "typo.key").write_text(text.replace('ranks = "0"', 'ranks = "0-"'))
    with pytest.raises(ValueError, match=r"typo\.key.*ranks '0-'"):
        CurveServerConfig(str(key_dir / "node.key_secret"), str(allowed)).validate()
    (allowed / "typo.key").write_text(text)
    (allowed / "copy.key").write_text(text.replace('ranks = "0"', 'ranks = "1"'))
    with pytest.raises(ValueError, match=r"copy\.key and typo\.key hold the same key with different ranks"):
        AllowList.load(allowed)


def test_a_worker_that_is_not_registered_says_so_on_a_timeout():
    from gpu_worker.links.diagnosis import _account

    assert "not registered there" in _account({"registered": True, "rank_registered": False})
    assert "has no job" in _account({"registered": False, "rank_registered": False})


def test_keys_register_only_as_their_ranks(start_node, keys, context):
    node = start_curve_node(start_node, keys)
    log = node.log_text()
    warning = next(line for line in log.splitlines() if "bound to no rank" in line)
    assert "free.key" in warning and "netoptim keygen --ranks" in warning and "w0.key" not in warning

    w1 = Peer(context, node.address, keys, "w1")
    text = assert_error(w1.hello(0), ErrorCode.FORBIDDEN, fingerprint(keys, "w1"), "w1.key", "rank(s) 1 only", "not as rank 0")
    assert "job" not in text
    # Refused before anything was held: the node still has no job (and rank 1 was not queued for rank 0).
    status = w1.request(Header(msg_type=MsgType.QUERY, rank=1))
    assert status.msg_type == MsgType.STATUS and status.meta == {"registered": False, "rank_registered": False}

    w0 = Peer(context, node.address, keys, "w0")
    assert_error(w0.hello(1), ErrorCode.FORBIDDEN, fingerprint(keys, "w0"), "w0.key", "rank(s) 0 only")
    owned = register_rank0(w0)
    assert owned

    w01_as_1 = Peer(context, node.address, keys, "w01")
    assert w01_as_1.hello(1).msg_type == MsgType.HELLO_OK  # a key for ranks 0-1 works for both
    w01_as_0 = Peer(context, node.address, keys, "w01")
    assert w01_as_0.hello(0).msg_type == MsgType.HELLO_OK  # (a new process as rank 0: it replaces w0's)
    free = Peer(context, node.address, keys, "free")
    assert free.hello(1).msg_type == MsgType.HELLO_OK  # a key bound to no rank may be any rank, with the warning above
    for peer in (w1, w0, w01_as_1, w01_as_0, free):
        peer.close()
    assert "FORBIDDEN" in node.log_text()


def test_another_key_cannot_take_over_a_registered_connection(start_node, keys, context):
    """ZeroMQ hands a routing id over to whoever connects with it (ROUTER_HANDOVER): the rank is the
    routing id *and* the key, so a peer with another key on rank 0's id is not rank 0."""
    node = start_curve_node(start_node, keys)
    rank0 = Peer(context, node.address, keys, "w0")
    owned = register_rank0(rank0)
    query = Header(msg_type=MsgType.QUERY, rank=0)
    assert "connected_ranks" in rank0.request(query).meta  # the real rank 0 gets the full status
    routing_id = rank0.routing_id
    rank0.close()

    intruder = Peer(context, node.address, keys, "w1", routing_id=routing_id)
    assert_error(intruder.request(Header(msg_type=MsgType.PULL, rank=0, bucket_id=owned[0])), ErrorCode.NOT_REGISTERED, "not registered as rank 0")
    values = torch.ones(128)
    assert_error(intruder.request(tensor_header(MsgType.INIT, values, rank=0, bucket_id=owned[0]), values), ErrorCode.NOT_REGISTERED)
    status = intruder.request(query)
    assert status.meta == {"registered": True, "rank_registered": False}
    assert "took over the rank's routing id" in node.log_text()
    intruder.close()

    back = Peer(context, node.address, keys, "w0", routing_id=routing_id)  # rank 0's own key on its own id is rank 0 again
    back.send(Header(msg_type=MsgType.PULL, rank=0, bucket_id=owned[0]))
    header, params = back.reply()
    assert header.msg_type == MsgType.PARAMS and params is not None and torch.equal(params, torch.full_like(params, 0.5))
    back.close()


def test_a_peer_that_is_not_registered_learns_nothing(start_node, keys, context):
    node = start_curve_node(start_node, keys)
    rank0 = Peer(context, node.address, keys, "w0")
    owned = register_rank0(rank0)
    stranger = Peer(context, node.address, keys, "free")  # an allowed key, any rank: but not registered
    gradient = torch.ones(JOB.plan()[owned[0]].numel)
    requests = [
        Header(msg_type=MsgType.PULL, rank=1, bucket_id=owned[0]),
        Header(msg_type=MsgType.PULL, rank=0, bucket_id=owned[0], meta={"at_step": 5}),
        tensor_header(MsgType.PUSH, gradient, rank=1, step=0, bucket_id=owned[0], meta={"hyper": [1e-3, 0.9, 0.999, 1e-8, 0.0]}),
        tensor_header(MsgType.INIT, gradient, rank=0, bucket_id=owned[0]),
        Header(msg_type=MsgType.CLIP, rank=0, step=0, meta={"sum_of_squares": 1.0}),
        Header(msg_type=MsgType.PULL, rank=1, bucket_id=99),  # a bucket nobody owns: still only "not registered"
    ]
    for request in requests:
        stranger.send(request, gradient if request.numel else None)
        header, payload = stranger.reply()
        text = assert_error(header, ErrorCode.NOT_REGISTERED, "not registered as rank", "HELLO")
        assert payload is None and "incarnation" not in text and "bucket" not in text
        assert_reveals_nothing(header)

    status = stranger.request(Header(msg_type=MsgType.QUERY, rank=1))
    assert status.msg_type == MsgType.STATUS and status.step == -1
    assert status.meta == {"registered": True, "rank_registered": False}

    assert stranger.request(Header(msg_type=MsgType.ECHO)) == Header(msg_type=MsgType.ECHO)
    probe = torch.arange(5, dtype=torch.float32)
    stranger.send(tensor_header(MsgType.ECHO, probe, step=3, bucket_id=4), probe)
    echoed, back = stranger.reply()
    assert echoed.msg_type == MsgType.ECHO and (echoed.step, echoed.bucket_id, echoed.meta) == (3, 4, {}) and torch.equal(back, probe)

    # A HELLO that does not match: which field, the worker's own value and a fingerprint; the registered layout only in the node's log.
    other_names = JobSpec(**{**{f: getattr(JOB, f) for f in JOB.__slots__}, "params": (ParamSpec("mine.weight", (20, 10), "float32", 0), JOB.params[1])})
    text = assert_error(stranger.hello(1, other_names), ErrorCode.LAYOUT_MISMATCH, "parameter 0 differs", "'mine.weight'", "fingerprint")
    other_size = JobSpec(**{**{f: getattr(JOB, f) for f in JOB.__slots__}, "world_size": 3})
    assert_error(stranger.hello(1, other_size), ErrorCode.LAYOUT_MISMATCH, "world_size differs", "this worker has 3")
    other_count = JobSpec(**{**{f: getattr(JOB, f) for f in JOB.__slots__}, "params": JOB.params[:1]})
    assert_error(stranger.hello(1, other_count), ErrorCode.LAYOUT_MISMATCH, "number of parameters differs", "this worker has 1")
    assert_error(stranger.hello(1, JOB, node_index=1), ErrorCode.LAYOUT_MISMATCH, "addressed this node as node 1")
    for job in (other_names, other_size, other_count):
        header = stranger.hello(1, job)
        assert_reveals_nothing(header)
        assert "registered 2" not in header.meta["message"]
    registered_print = text.split("fingerprint ")[1][:12]
    log = node.log_text()
    assert f"registered job {registered_print}" in log and "encoder.secret_kernel" in log  # the operator sees what differs

    # Registered now, the same connection gets the full status.
    assert stranger.hello(1).msg_type == MsgType.HELLO_OK
    status = stranger.request(Header(msg_type=MsgType.QUERY, rank=1))
    assert status.meta["registered"] is True and status.meta["connected_ranks"] == [0, 1]
    for peer in (rank0, stranger):
        peer.close()


def test_a_worker_with_a_key_for_another_rank_is_told_why(start_node, keys):
    node = start_curve_node(start_node, keys)
    key_dir, _ = keys
    model = torch.nn.Linear(4, 2)
    options = {"nodes": [node.address], "world_size": 1, "timeout_s": 10, "curve_server_key": str(key_dir / "node.key")}
    with pytest.raises(RuntimeError, match=r"FORBIDDEN.*w1\.key.*rank\(s\) 1 only, not as rank 0"):
        RemoteAdamW(model.parameters(), rank=0, curve_secret_key=str(key_dir / "w1.key_secret"), **options)
    opt = RemoteAdamW(model.parameters(), rank=0, curve_secret_key=str(key_dir / "w0.key_secret"), **options)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert opt.remote_step == 1
    opt.close()


class _NeverDone(SendHandle):
    """A send whose peer never reads: its payload stays with the node."""

    def done(self) -> bool:
        return False

    def wait(self, timeout_s: float) -> None:
        raise TimeoutError


class _SilentEndpoint:
    """Takes every answer and never lets one go: a peer that does not read."""

    def __init__(self) -> None:
        self.sent: list[Header] = []
        self.peers: list[bytes] = []

    def send(self, peer: bytes, header: Header, payload=None, *, track: bool = False) -> SendHandle:
        self.sent.append(header)
        self.peers.append(peer)
        return _NeverDone()


def test_echoes_a_peer_does_not_read_are_bounded():
    """The node sends an ECHO's payload back without a copy: a peer that never reads would pin what it
    sends. Past --max-echo-bytes of echoes on their way back, ECHO is answered with LIMIT."""
    node = NodeDaemon(NodeConfig(same_host_ipc=False, max_echo_bytes=3 * 4096))
    real_endpoint, node._endpoint = node._endpoint, _SilentEndpoint()  # type: ignore[assignment]
    node._echoes._endpoint = node._outgoing._endpoint = node._endpoint  # the echoes and the errors go out on it too
    try:
        payload = torch.zeros(1024)  # 4 KiB
        frames = [memoryview(frame) for frame in encode_message(tensor_header(MsgType.ECHO, payload), payload)[1:]]
        header = tensor_header(MsgType.ECHO, payload)
        for _ in range(4):
            node.handle(Message(peer=b"\x02peer123", header=header, tensors=payload_views(header, frames, max_bytes=1 << 20)))
        sent = node._endpoint.sent  # type: ignore[attr-defined]
        assert [h.msg_type for h in sent] == [MsgType.ECHO] * 3 + [MsgType.ERROR]
        assert sent[-1].meta["code"] == ErrorCode.LIMIT and "read the echoes" in sent[-1].meta["message"]
    finally:
        node._endpoint = real_endpoint
        node.close()


def test_answers_peers_outside_the_job_do_not_read_are_bounded(caplog):
    """Every request of a peer outside the job is answered (ERROR, STATUS), small as the answer is: a
    peer that never reads would grow the node's send queue. Its answers waiting to leave are bounded
    (a 16th of --max-unread-reply-bytes per peer); beyond, they are dropped and said once in the log,
    and another peer is still answered."""
    node = NodeDaemon(NodeConfig(same_host_ipc=False, max_unread_reply_bytes=16 * 1024))
    real_endpoint, node._endpoint = node._endpoint, _SilentEndpoint()  # type: ignore[assignment]
    node._outgoing._endpoint = node._endpoint  # what the node sends goes out on it
    try:
        with caplog.at_level(logging.WARNING, logger="optimizer_node"):
            for _ in range(200):
                node.handle(Message(peer=b"\x02reader0", header=Header(msg_type=MsgType.QUERY), tensors=[]))
                node.handle(Message(peer=b"\x02reader0", header=Header(msg_type=MsgType.PULL, rank=3, bucket_id=0), tensors=[]))
            node.handle(Message(peer=b"\x02another", header=Header(msg_type=MsgType.QUERY), tensors=[]))
        endpoint = node._endpoint  # type: ignore[attr-defined]
        to_first = endpoint.peers.count(b"\x02reader0")
        assert 0 < to_first < 100, to_first  # 1 KiB for this peer: a dozen answers, not 400
        assert endpoint.peers[-1] == b"\x02another"
        assert node._outgoing.outsider_budget.held_bytes <= 16 * 1024
        assert node._outgoing.outsider_budget.dropped == 400 - to_first
        said = [record.getMessage() for record in caplog.records if "--max-unread-reply-bytes" in record.getMessage()]
        assert len(said) == 1, said  # rate-limited
    finally:
        node._endpoint = real_endpoint
        node.close()
