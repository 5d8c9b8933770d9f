"""What every transport configuration must do, run over each one: ZeroMQ over tcp, ipc (payloads in
shared windows, and on the socket only) and tcp with CURVE, and the Mooncake Transfer Engine over its
tcp protocol."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.transport.availability import requires_mooncake
from transport import backend_for, create_transport
from transport.wire import ErrorCode, Header, MsgType, WireError, tensor_header
from transport.zeromq.security import CurveClientConfig, CurveServerConfig, generate_keypair

CHUNK = 1 << 16
MOONCAKE_WINDOW = 16 << 20  # smaller than the 12 MiB case plus what is in flight: windows fill and drain
KINDS = ["tcp", "ipc", "ipc-socket-only", "tcp-curve", "tcp-4-lanes", pytest.param("mooncake", marks=requires_mooncake)]


def url_of(kind: str, tmp_path) -> str:
    return {"ipc": f"ipc://{tmp_path}/node.sock", "ipc-socket-only": f"ipc://{tmp_path}/node.sock", "mooncake": "mooncake://127.0.0.1:0"}.get(
        kind, "tcp://127.0.0.1:0"
    )


class Pair:
    """A server endpoint and a factory of clients for one configuration."""

    def __init__(self, kind: str, tmp_path) -> None:
        url = url_of(kind, tmp_path)
        server_options, self.client_options, self.secret, self.server_key = {}, {}, "-", "-"
        if kind == "mooncake":
            server_options = self.client_options = {"window_bytes": MOONCAKE_WINDOW}
        if kind == "ipc-socket-only":  # payloads on the socket, not in shared windows
            self.client_options = {"shared_memory": False}
        if kind == "tcp-4-lanes":
            self.client_options = {"connections_per_peer": 4}
        if kind == "tcp-curve":
            node_public, node_secret = generate_keypair(str(tmp_path / "keys"), "node")
            _, worker_secret = generate_keypair(str(tmp_path / "allowed"), "worker")
            server_options = {"curve_server": CurveServerConfig(str(node_secret), str(tmp_path / "allowed"))}
            self.client_options = {"curve_client": CurveClientConfig(str(worker_secret), str(node_public))}
            self.secret, self.server_key = str(worker_secret), str(node_public)
        self.server_transport = create_transport(url, chunk_bytes=CHUNK, max_message_bytes=1 << 30, **server_options)
        self.server = self.server_transport.bind(url)
        self.client_transport = create_transport(url, chunk_bytes=CHUNK, max_message_bytes=1 << 30, **self.client_options)
        self.clients = []

    def client(self):
        client = self.client_transport.connect(self.server.address)
        self.clients.append(client)
        return client

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.server.close()
        self.client_transport.close()
        self.server_transport.close()


@pytest.fixture(params=KINDS)
def pair(request, tmp_path):
    pair = Pair(request.param, tmp_path)
    yield pair
    pair.close()


def echo(pair: Pair, client, payload: torch.Tensor, bucket_id: int = 5) -> torch.Tensor:
    client.send(tensor_header(MsgType.ECHO, payload, chunk_bytes=CHUNK, step=7, bucket_id=bucket_id), payload).wait(10)
    message = pair.server.recv(30)
    assert message is not None and message.header.step == 7 and message.header.numel == payload.numel()
    handle = pair.server.send(message.peer, message.header, [view for _, view in message.tensors])
    del message
    handle.wait(10)  # a send completes on calls into its endpoint (mooncake: the write, then the header)
    assert handle.done()
    assert pair.client_transport.wait_readable([client], 30) == [0]
    back = client.recv(1)
    result = torch.cat([view for _, view in back.tensors]) if back.tensors else torch.empty(0, dtype=payload.dtype)
    del back
    # What a node's loop does next: call its endpoint again, which gives back the buffer space the
    # message held (the mooncake backend's window slots return as credits on the next call).
    assert pair.server.recv(0) is None
    return result


def test_bound_address_is_real(pair):
    assert not pair.server.address.endswith(":0") and not pair.server.address.endswith(":*")


@pytest.mark.parametrize("numel", [1, 3, CHUNK // 4 - 1, CHUNK // 4 + 1, 3 << 20], ids=["1", "3", "under-a-chunk", "over-a-chunk", "12MiB"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_and_large_tensors_arrive_intact(pair, numel, dtype):
    payload = torch.randn(numel).to(dtype)
    client = pair.client()
    for _ in range(3):  # the first message on a new connection, then the ones after it (mooncake: inline, then one-sided)
        assert torch.equal(echo(pair, client, payload), payload)


def test_messages_keep_their_order(pair):
    client = pair.client()
    for step in range(50):
        client.send(Header(msg_type=MsgType.QUERY, step=step))
    assert [pair.server.recv(10).header.step for _ in range(50)] == list(range(50))


def test_many_clients_at_once(pair):
    clients = [pair.client() for _ in range(8)]

    def send_all(index: int) -> None:
        for step in range(20):
            payload = torch.full((1000,), float(index))
            handle = clients[index].send(tensor_header(MsgType.ECHO, payload, rank=index, step=step), payload)
        handle.wait(30)  # the last one is on its way before this thread stops calling its endpoint

    threads = [threading.Thread(target=send_all, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    received: dict[int, list[int]] = {i: [] for i in range(8)}
    for _ in range(160):
        message = pair.server.recv(30)
        assert message is not None
        assert torch.all(message.tensors[0][1] == message.header.rank)
        received[message.header.rank].append(message.header.step)
    for thread in threads:
        thread.join()
    assert all(steps == list(range(20)) for steps in received.values())  # per-peer order kept


def test_malformed_message_names_its_peer_and_the_endpoint_goes_on(pair):
    client = pair.client()
    client.send_raw([b"junk"])
    with pytest.raises(WireError) as info:
        pair.server.recv(10)
    assert info.value.code == ErrorCode.MALFORMED and info.value.peer
    client.send(Header(msg_type=MsgType.QUERY))
    assert pair.server.recv(10).header.msg_type == MsgType.QUERY


def test_timeouts_return_none(pair):
    client = pair.client()
    assert pair.server.recv(0.05) is None
    assert client.recv(0.05) is None
    assert pair.client_transport.wait_readable([client], 0.05) == []


def test_send_to_a_vanished_peer_raises(pair):
    with pytest.raises(ConnectionError):
        pair.server.send(b"nobody", Header(msg_type=MsgType.ACK))


def test_a_peer_that_dies_mid_message_leaves_nothing_behind(pair):
    from tests.transport.peer_that_dies import MESSAGE_NUMEL

    dying = subprocess.Popen(
        [sys.executable, "-m", "tests.transport.peer_that_dies", pair.server.address, pair.secret, pair.server_key, str(CHUNK), str(MOONCAKE_WINDOW)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert dying.stdout.readline().strip() == "sending"

    def drain(seconds: float, quiet_for: float | None = None) -> int:
        """Read for ``seconds`` (or until nothing came for ``quiet_for``): every message that arrives is whole and intact."""
        count, deadline, last = 0, time.monotonic() + seconds, time.monotonic()
        while time.monotonic() < deadline:
            message = pair.server.recv(0.05)
            if message is None:
                if quiet_for is not None and time.monotonic() - last >= quiet_for:
                    break
                continue
            assert message.header.numel == MESSAGE_NUMEL
            assert all(bool(torch.all(view == 1)) for _, view in message.tensors)
            count, last = count + 1, time.monotonic()
        return count

    drain(0.1)  # reading while it writes, so the kill lands inside a message
    dying.kill()
    dying.wait(10)
    # The half message is dropped, not delivered; whole messages the peer finished before it died may still
    # arrive late on a loaded machine, so read until the line has been quiet for a second.
    drain(30.0, quiet_for=1.0)
    payload = torch.arange(100, dtype=torch.float32)
    assert torch.equal(echo(pair, pair.client(), payload), payload)  # and everyone else is served


def test_unsupported_addresses():
    with pytest.raises(ValueError, match="needs a scheme"):
        backend_for("127.0.0.1:5555")
    with pytest.raises(ValueError, match="unsupported scheme 'udp'"):
        backend_for("udp://127.0.0.1:5555")


@requires_mooncake
def test_mooncake_moves_payloads_by_one_sided_writes_into_windows_it_reuses(tmp_path):
    pair = Pair("mooncake", tmp_path)
    try:
        client = pair.client()
        payload = torch.randn(3 << 20)  # 12 MiB: 192 of the window's 256 slots
        for _ in range(5):  # 60 MiB through a 16 MiB window: slots come back and are reused
            assert torch.equal(echo(pair, client, payload), payload)
        sent = payload.numel() * 4
        assert client.inline_bytes == sent  # the first, before the handshake
        assert client.written_bytes == 4 * sent and pair.server.written_bytes == 5 * sent
        assert client.staged_bytes == pair.server.staged_bytes == 0  # over TCP the engine reads any memory: nothing staged
        assert client.recv(0) is None  # its next call sends the credits for what it read
        assert not client.busy() and not pair.server.busy()  # every write done, every slot given back
    finally:
        pair.close()


def test_lanes_keep_each_buckets_order_and_the_node_sees_one_peer(tmp_path):
    pair = Pair("tcp-4-lanes", tmp_path)
    try:
        client = pair.client()
        assert len(client.sockets) == 4
        for step in range(10):
            for bucket_id in range(8):  # two buckets per lane
                payload = torch.full((5000,), float(100 * bucket_id + step))
                client.send(tensor_header(MsgType.ECHO, payload, bucket_id=bucket_id, step=step), payload)
        client.send(Header(msg_type=MsgType.QUERY, step=99))  # no bucket: lane 0
        steps: dict[int, list[int]] = {b: [] for b in range(8)}
        peers = set()
        for _ in range(81):
            message = pair.server.recv(30)
            peers.add(message.peer)
            if message.header.msg_type == MsgType.QUERY:
                continue
            bucket_id, step = message.header.bucket_id, message.header.step
            assert torch.all(message.tensors[0][1] == 100 * bucket_id + step)
            steps[bucket_id].append(step)
            pair.server.send(message.peer, message.header, [view for _, view in message.tensors]).wait(10)
        assert len(peers) == 1  # four connections, one peer
        assert all(order == list(range(10)) for order in steps.values())
        back: dict[int, list[int]] = {b: [] for b in range(8)}
        for _ in range(80):  # the replies come back over the lane of their bucket, each bucket in order
            message = client.recv(30)
            back[message.header.bucket_id].append(message.header.step)
        assert all(order == list(range(10)) for order in back.values())
        with pytest.raises(ValueError, match=r"connections per node must be in \[1, 255\]"):
            create_transport("tcp://127.0.0.1:1", connections_per_peer=0)
    finally:
        pair.close()
