"""The Mooncake transport beyond the conformance suite: what it refuses, and what a user without it sees."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest
import torch

from tests.transport.availability import requires_mooncake
from transport import backend_for, create_transport
from transport.wire import ErrorCode, Header, MsgType, WireError, encode_header, tensor_header


def test_addresses_pick_the_backend_and_protocol():
    assert backend_for("mooncake://10.0.0.11:5555") == backend_for("mooncake+rdma://10.0.0.11:5555") == "mooncake"
    from transport.mooncake.link import split_address

    assert split_address("mooncake://10.0.0.11:5555") == ("tcp", "10.0.0.11", "5555")
    assert split_address("mooncake+rdma://node-3:5555") == ("rdma", "node-3", "5555")
    with pytest.raises(ValueError, match="expected mooncake://HOST:PORT"):
        split_address("mooncake://10.0.0.11")


def test_without_the_package_the_error_says_what_to_install():
    """A fresh interpreter where ``mooncake`` cannot be imported: binding names the extra and the libraries."""
    code = (
        "import sys; sys.modules['mooncake'] = None\n"
        "from transport import create_transport\n"
        "try:\n"
        "    create_transport('mooncake://127.0.0.1:0').bind('mooncake://127.0.0.1:0')\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.startswith("TransportUnavailable"), result.stdout + result.stderr
    assert "pip install 'netoptim-train[rdma]'" in result.stdout and "libibverbs1 librdmacm1 libnuma1" in result.stdout


def test_curve_is_refused_with_the_alternative():
    with pytest.raises(ValueError, match="does not encrypt: use tcp:// with CURVE"):
        create_transport("mooncake://127.0.0.1:0", curve_client=object())


@requires_mooncake
def test_bad_control_frames_are_refused_and_the_connection_goes_on():
    transport = create_transport("mooncake://127.0.0.1:0", window_bytes=1 << 20, chunk_bytes=1 << 16)
    server = transport.bind("mooncake://127.0.0.1:0")
    client = transport.connect(server.address)
    try:
        payload = torch.arange(1000, dtype=torch.float32)
        client.send(tensor_header(MsgType.ECHO, payload, chunk_bytes=1 << 16), payload).wait(10)
        assert torch.equal(server.recv(10).tensors[0][1], payload)  # the first message went inline
        assert client.recv(0.2) is None  # the client takes the server's handshake
        header = encode_header(tensor_header(MsgType.ECHO, payload, chunk_bytes=1 << 16))
        cases = [
            ([b"X", b"?"], ErrorCode.MALFORMED, "not a mooncake transport frame"),
            ([b"M", b"\xff", msgpack.packb([0])], ErrorCode.MALFORMED, ""),  # not a header
            ([b"M", header, b"\xc1"], ErrorCode.MALFORMED, "slot list is not msgpack"),
            ([b"M", header, msgpack.packb([10_000])], ErrorCode.BAD_PAYLOAD, "outside the window"),
            ([b"M", header, msgpack.packb([1, 1])], ErrorCode.BAD_PAYLOAD, "outside the window"),  # a slot twice
            ([b"M", header, msgpack.packb([])], ErrorCode.BAD_PAYLOAD, "the slot list names 0"),
            ([b"H", b"not msgpack"], ErrorCode.MALFORMED, "handshake"),
            ([b"H", msgpack.packb({"engine": "x", "base": 0, "slots": 1, "slot_bytes": 4096})], ErrorCode.BAD_PAYLOAD, "same chunk size"),
        ]
        for frames, code, text in cases:
            client.send_raw(frames)
            with pytest.raises(WireError) as info:
                server.recv(10)
            assert info.value.code == code and text in str(info.value), frames
        for _ in range(3):  # the connection and its window still work, one-sided now
            client.send(tensor_header(MsgType.ECHO, payload, chunk_bytes=1 << 16), payload).wait(10)
            message = server.recv(10)
            assert torch.equal(message.tensors[0][1], payload)
            del message
        assert client.written_bytes == 3 * payload.numel() * 4
    finally:
        client.close()
        server.close()
        transport.close()


@requires_mooncake
def test_a_payload_larger_than_the_window_is_refused_before_anything_is_written():
    transport = create_transport("mooncake://127.0.0.1:0", window_bytes=1 << 20, chunk_bytes=1 << 16)
    server = transport.bind("mooncake://127.0.0.1:0")
    client = transport.connect(server.address)
    try:
        client.send(Header(msg_type=MsgType.QUERY)).wait(10)
        assert server.recv(10).header.msg_type == MsgType.QUERY
        assert client.recv(0.2) is None  # takes the handshake
        big = torch.zeros(1 << 19)  # 2 MiB > the 1 MiB window
        with pytest.raises(ValueError, match="larger than the 1048576-byte receive window: raise window_bytes"):
            client.send(tensor_header(MsgType.ECHO, big, chunk_bytes=1 << 16), big)
        assert client.written_bytes == 0
    finally:
        client.close()
        server.close()
        transport.close()


def test_a_job_does_not_mix_transports():
    from gpu_worker import RemoteAdamW

    with pytest.raises(ValueError, match=r"these addresses mix \['mooncake', 'zmq'\]"):
        RemoteAdamW(torch.nn.Linear(2, 2).parameters(), nodes=["tcp://127.0.0.1:1", "mooncake://127.0.0.1:2"], rank=0, world_size=1)
    with pytest.raises(ValueError, match="MC_TCP_LANES_PER_PEER"):
        create_transport("mooncake://127.0.0.1:0", connections_per_peer=2)
