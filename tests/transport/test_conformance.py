"""What every transport configuration must do, run over each one: tcp, ipc, and tcp with CURVE."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from transport import backend_for, create_transport
from transport.security import CurveClientConfig, CurveServerConfig, generate_keypair
from transport.wire import ErrorCode, Header, MsgType, WireError, tensor_header

CHUNK = 1 << 16


class Pair:
    """A server endpoint and a factory of clients for one configuration."""

    def __init__(self, kind: str, tmp_path) -> None:
        url = f"ipc://{tmp_path}/node.sock" if kind == "ipc" else "tcp://127.0.0.1:0"
        server_options, self.client_options, self.secret, self.server_key = {}, {}, "-", "-"
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


@pytest.fixture(params=["tcp", "ipc", "tcp-curve"])
def pair(request, tmp_path):
    pair = Pair(request.param, tmp_path)
    yield pair
    pair.close()


def echo(pair: Pair, client, payload: torch.Tensor) -> torch.Tensor:
    client.send(tensor_header(MsgType.ECHO, payload, chunk_bytes=CHUNK, step=7), payload)
    message = pair.server.recv(30)
    assert message is not None and message.header.step == 7 and message.header.numel == payload.numel()
    handle = pair.server.send(message.peer, message.header, [view for _, view in message.tensors])
    assert pair.client_transport.wait_readable([client], 30) == [0]
    back = client.recv(1)
    handle.wait(10)
    assert handle.done()
    return torch.cat([view for _, view in back.tensors]) if back.tensors else torch.empty(0, dtype=payload.dtype)


def test_bound_address_is_real(pair):
    assert not pair.server.address.endswith(":0") and not pair.server.address.endswith(":*")


@pytest.mark.parametrize("numel", [1, 3, CHUNK // 4 - 1, CHUNK // 4 + 1, 3 << 20], ids=["1", "3", "under-a-chunk", "over-a-chunk", "12MiB"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_and_large_tensors_arrive_intact(pair, numel, dtype):
    payload = torch.randn(numel).to(dtype)
    assert torch.equal(echo(pair, pair.client(), payload), payload)


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
            clients[index].send(tensor_header(MsgType.ECHO, payload, rank=index, step=step), payload)

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
    dying = subprocess.Popen(
        [sys.executable, "-m", "tests.transport.peer_that_dies", pair.server.address, pair.secret, pair.server_key],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert dying.stdout.readline().strip() == "sending"
    dying.kill()
    dying.wait(10)
    assert pair.server.recv(1.0) is None  # the half message is dropped, not delivered
    payload = torch.arange(100, dtype=torch.float32)
    assert torch.equal(echo(pair, pair.client(), payload), payload)  # and everyone else is served


def test_unsupported_addresses():
    with pytest.raises(ValueError, match="needs a scheme"):
        backend_for("127.0.0.1:5555")
    with pytest.raises(ValueError, match="unsupported scheme 'udp'"):
        backend_for("udp://127.0.0.1:5555")
