"""The ZeroMQ backend over real sockets, for every address kind it serves."""

from __future__ import annotations

import pytest
import torch

from transport import backend_for, create_transport
from transport.wire import ErrorCode, Header, MsgType, WireError, tensor_header


@pytest.fixture(params=["tcp", "ipc"])
def url(request, tmp_path):
    return "tcp://127.0.0.1:0" if request.param == "tcp" else f"ipc://{tmp_path}/node.sock"


@pytest.fixture
def pair(url):
    transport = create_transport(url, chunk_bytes=1 << 16, max_message_bytes=64 << 20)
    server = transport.bind(url)
    client = transport.connect(server.address)
    yield transport, server, client
    client.close()
    server.close()
    transport.close()


def test_bound_address_is_real(pair, url):
    _, server, _ = pair
    assert server.address.startswith(url.split("://")[0]) and not server.address.endswith(":0")


def test_round_trip_small_and_large(pair):
    transport, server, client = pair
    small, large = torch.arange(10, dtype=torch.float32), torch.randn(3 << 20)  # 12 MiB: 192 chunks
    for payload in (small, large):
        client.send(tensor_header(MsgType.ECHO, payload, chunk_bytes=1 << 16, step=7), payload).wait(10)
        message = server.recv(10)
        assert message.header.step == 7 and message.header.numel == payload.numel()
        received = torch.cat([view for _, view in message.tensors])
        assert torch.equal(received, payload)
        handle = server.send(message.peer, message.header, [view for _, view in message.tensors])
        assert transport.wait_readable([client], 10) == [0]
        echoed = client.recv(1)
        handle.wait(10)
        assert handle.done() and torch.equal(torch.cat([v for _, v in echoed.tensors]), payload)


def test_messages_keep_their_order(pair):
    _, server, client = pair
    for step in range(50):
        client.send(Header(msg_type=MsgType.QUERY, step=step))
    assert [server.recv(5).header.step for _ in range(50)] == list(range(50))


def test_malformed_message_names_its_peer(pair):
    _, server, client = pair
    client.send_raw([b"junk"])
    with pytest.raises(WireError) as info:
        server.recv(5)
    assert info.value.code == ErrorCode.MALFORMED and info.value.peer
    client.send(Header(msg_type=MsgType.QUERY))  # the endpoint is still usable
    assert server.recv(5).header.msg_type == MsgType.QUERY


def test_timeouts_return_none(pair):
    transport, server, client = pair
    assert server.recv(0.05) is None
    assert client.recv(0.05) is None
    assert transport.wait_readable([client], 0.05) == []


def test_send_to_a_vanished_peer_raises(pair):
    _, server, _ = pair
    with pytest.raises(ConnectionError):
        server.send(b"nobody", Header(msg_type=MsgType.ACK))


def test_unsupported_addresses():
    with pytest.raises(ValueError, match="needs a scheme"):
        backend_for("127.0.0.1:5555")
    with pytest.raises(ValueError, match="unsupported scheme 'udp'"):
        backend_for("udp://127.0.0.1:5555")
