"""The same-host shared-memory path: payloads copied once into the peer's window, read there in
place, extents given back as credits, and the socket whenever the windows cannot be used."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import msgpack
import pytest
import torch

from transport.shm.same_host import CREDIT, HANDSHAKE, SHARED, SharedPeers
from transport.shm.window import TRIM_PERIOD_S, UNIT_BYTES, SharedWindow, WindowWriter, window_holding
from transport.wire import ErrorCode, Header, MsgType, WireError, encode_header, tensor_header
from transport.zeromq.backend import ZmqTransport

CHUNK = 1 << 16


class Link:
    """A node endpoint on ``ipc://`` and one worker endpoint connected to it."""

    def __init__(self, tmp_path, *, window_bytes: int = 4 << 20, shared_memory: bool = True) -> None:
        self.server_transport = ZmqTransport(chunk_bytes=CHUNK, same_host_window_bytes=window_bytes)
        self.server = self.server_transport.bind(f"ipc://{tmp_path}/node.sock")
        self.client_transport = ZmqTransport(chunk_bytes=CHUNK, shared_memory=shared_memory)
        self.client = self.client_transport.connect(self.server.address)
        self.client.send(Header(msg_type=MsgType.QUERY, rank=0))
        query = self.server.recv(10)
        assert query is not None and query.header.msg_type == MsgType.QUERY
        self.peer = query.peer
        self.server.send(self.peer, Header(msg_type=MsgType.STATUS))
        assert self.client.recv(10).header.msg_type == MsgType.STATUS  # the handshake's answer came first
        self.server.recv(0.2)  # the worker's "mapped"

    def push(self, payload, bucket_id: int = 0):
        """Send ``payload`` to the node; the message as the node got it."""
        self.client.send(tensor_header(MsgType.PUSH, payload, chunk_bytes=CHUNK, bucket_id=bucket_id, step=1), payload)
        message = self.server.recv(10)
        assert message is not None and message.header.bucket_id == bucket_id
        return message

    def pull(self, payload, bucket_id: int = 0):
        self.server.send(self.peer, tensor_header(MsgType.PARAMS, payload, chunk_bytes=CHUNK, bucket_id=bucket_id), payload)
        message = self.client.recv(10)
        assert message is not None and message.header.bucket_id == bucket_id
        return message

    def close(self) -> None:
        self.client.close()
        self.server.close()
        self.client_transport.close()
        self.server_transport.close()


@pytest.fixture
def link(tmp_path):
    pair = Link(tmp_path)
    yield pair
    pair.close()


def joined(message) -> torch.Tensor:
    return torch.cat([view for _, view in message.tensors])


def test_payloads_go_through_the_windows_bitwise_both_ways(link):
    assert link.client.shared.connection is not None and link.server._shared.connections[link.peer].ready
    for dtype in (torch.float32, torch.bfloat16):
        values = torch.randn(300_001).to(dtype)
        pieces = [values[:100_000].clone(), values[100_000:].clone()]  # a payload of two tensors, cut in chunks
        got = link.push(pieces)
        assert torch.equal(joined(got), values)
        back = link.pull([view for _, view in got.tensors])
        del got
        assert torch.equal(joined(back), values)
    assert link.client.shared.connection.writer.written_bytes > 0 and link.server.shared_written_bytes > 0


def test_views_are_read_in_place_and_their_extent_comes_back_when_the_last_one_goes(link):
    writer = link.client.shared.connection.writer
    message = link.push(torch.ones(1 << 18))
    view = message.tensors[0][1][10:20]  # a view of a view keeps the extent
    del message
    link.server.recv(0.05)
    link.client.recv(0.05)
    assert writer.lent_bytes == 1 << 20
    assert torch.equal(view, torch.ones(10))
    del view
    link.server.recv(0.05)  # the node sends the credit on its next call
    link.client.recv(0.05)
    assert writer.lent_bytes == 0


def test_a_full_window_sends_on_the_socket_and_the_window_is_used_again_once_freed(link):
    writer = link.client.shared.connection.writer
    held = [link.push(torch.full((1 << 19,), float(i)), bucket_id=i) for i in range(3)]  # 3 x 2 MiB into 4 MiB
    assert writer.written_bytes == 4 << 20, "the third went on the socket"
    assert [joined(message)[0].item() for message in held] == [0.0, 1.0, 2.0]
    del held
    link.server.recv(0.05)
    link.client.recv(0.05)
    assert writer.lent_bytes == 0
    assert torch.equal(joined(link.push(torch.full((1 << 19,), 7.0))), torch.full((1 << 19,), 7.0))
    assert writer.written_bytes == 6 << 20


def test_small_payloads_and_no_payload_go_on_the_socket(link):
    got = link.push(torch.arange(100, dtype=torch.float32))
    assert torch.equal(joined(got), torch.arange(100, dtype=torch.float32))
    assert link.client.shared.connection.writer.written_bytes == 0


def test_a_node_without_windows_says_so_and_payloads_stay_on_the_socket(tmp_path):
    link = Link(tmp_path, window_bytes=0)
    try:
        assert link.client.shared.connection is None and "on its socket" in link.client.shared.refused
        assert torch.equal(joined(link.push(torch.ones(1 << 18))), torch.ones(1 << 18))
    finally:
        link.close()


def test_a_worker_that_does_not_ask_gets_no_windows(tmp_path):
    link = Link(tmp_path, shared_memory=False)
    try:
        assert link.client.shared is None and not link.server._shared.connections
        assert torch.equal(joined(link.pull(torch.ones(1 << 18))), torch.ones(1 << 18))
    finally:
        link.close()


def test_bad_shared_memory_frames_are_refused_and_the_node_keeps_serving(link):
    header = encode_header(tensor_header(MsgType.PUSH, torch.ones(1 << 14), chunk_bytes=CHUNK, step=1))
    bad = [
        ([SHARED, header, msgpack.packb([4 << 20, [CHUNK]])], ErrorCode.BAD_PAYLOAD),  # past the window's end
        ([SHARED, header, msgpack.packb([UNIT_BYTES, [CHUNK, CHUNK]])], ErrorCode.BAD_PAYLOAD),  # not the declared size
        ([SHARED, header, msgpack.packb([100, [CHUNK]])], ErrorCode.BAD_PAYLOAD),  # not on a unit
        ([SHARED, header, b"\xc1"], ErrorCode.MALFORMED),
        ([HANDSHAKE, b"\x93\x01\x02\x03"], ErrorCode.MALFORMED),
        ([HANDSHAKE, msgpack.packb({"what": 1})], ErrorCode.MALFORMED),
        ([SHARED, header], ErrorCode.MALFORMED),
    ]
    for frames, code in bad:
        link.client.send_raw(frames)
        with pytest.raises(WireError) as caught:
            link.server.recv(10)
        assert caught.value.code == code and caught.value.peer == link.peer
    link.client.send_raw([CREDIT, msgpack.packb([0, 12345, "x", -1])])  # extents never lent: ignored
    assert link.server.recv(0.2) is None
    assert link.server._shared.connections[link.peer].writer.lent_bytes == 0
    assert torch.equal(joined(link.push(torch.ones(1 << 18))), torch.ones(1 << 18))


def test_the_windows_go_when_the_worker_closes_or_its_process_exits(link, tmp_path):
    link.client.close()
    link.server.recv(0.3)
    assert not link.server._shared.connections
    script = textwrap.dedent(
        f"""
        import sys, time
        from transport.zeromq.backend import ZmqTransport
        from transport.wire import Header, MsgType
        client = ZmqTransport().connect({link.server.address!r})
        client.send(Header(msg_type=MsgType.QUERY, rank=0))
        while client.recv(1.0) is None or client.shared.connection is None:
            pass
        print("mapped", flush=True)
        time.sleep(60)
        """
    )
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        deadline = time.monotonic() + 30
        while not link.server._shared.connections and time.monotonic() < deadline:
            message = link.server.recv(0.2)
            if message is not None:
                link.server.send(message.peer, Header(msg_type=MsgType.STATUS))
        assert link.server._shared.connections
        assert worker.stdout.readline().strip() == "mapped"
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        deadline = time.monotonic() + 10
        while link.server._shared.connections and time.monotonic() < deadline:
            link.server.recv(0.1)
        assert not link.server._shared.connections, "a dead worker's windows are freed"
    finally:
        worker.kill()
        worker.wait()


def test_views_outlive_a_closed_endpoint(tmp_path):
    link = Link(tmp_path)
    message = link.push(torch.full((1 << 18,), 3.0))
    link.close()
    assert torch.equal(joined(message), torch.full((1 << 18,), 3.0)), "the mapping stays while a view of it does"


def test_a_window_opens_only_as_the_sealed_file_it_was_named():
    window = SharedWindow.create(UNIT_BYTES * 4, "netoptim-test-window")
    try:
        with pytest.raises(OSError, match="not the window"):
            SharedWindow.open(os.getpid(), window.fd, window.nbytes, "netoptim-other")
        with pytest.raises(OSError, match="not sealed at"):
            SharedWindow.open(os.getpid(), window.fd, window.nbytes * 2, window.name)
        same = SharedWindow.open(os.getpid(), window.fd, window.nbytes, window.name)
        window.bytes[:4] = 9
        assert same.bytes[:4].tolist() == [9] * 4
        same.close()
        with pytest.raises(ValueError):
            SharedWindow.create(100, "netoptim-odd")
    finally:
        window.close()


def test_a_node_gives_windows_to_at_most_max_peers_connections():
    watched = []
    peers = SharedPeers(watched.append, watched.remove, window_bytes=UNIT_BYTES * 4, max_peers=1)
    first = msgpack.unpackb(peers.handshake(b"a", msgpack.packb({"pid": os.getpid()})))
    second = msgpack.unpackb(peers.handshake(b"b", msgpack.packb({"pid": os.getpid()})))
    assert "write" in first and "at most" in second["refused"] and len(watched) == 1
    assert "not visible" in msgpack.unpackb(peers.handshake(b"a", msgpack.packb({"pid": 2**22 + 12345})))["refused"]
    assert not peers.connections and not watched, "a new handshake replaces the old windows"
    peers.close()


def test_the_writer_reuses_freed_extents_in_any_order_and_joins_them():
    window = SharedWindow.create(UNIT_BYTES * 8, "netoptim-test-writer")
    writer = WindowWriter(window)
    two_units = torch.zeros(UNIT_BYTES // 2)  # 2 units of fp32 bytes
    extents = [msgpack.unpackb(writer.write(two_units, CHUNK))[0] for _ in range(4)]
    assert extents == [0, 2 * UNIT_BYTES, 4 * UNIT_BYTES, 6 * UNIT_BYTES]
    assert writer.write(two_units, CHUNK) is None
    writer.credit([2 * UNIT_BYTES, 6 * UNIT_BYTES, 2 * UNIT_BYTES])  # a second credit of one extent is ignored
    assert writer.write(torch.zeros(UNIT_BYTES), CHUNK) is None, "no 4 units in a row are free"
    writer.credit([4 * UNIT_BYTES])
    assert msgpack.unpackb(writer.write(torch.zeros(UNIT_BYTES * 3 // 2), CHUNK))[0] == 2 * UNIT_BYTES  # 6 joined units
    writer.credit([0, 2 * UNIT_BYTES])
    assert writer.lent_bytes == 0 and writer._free == [(0, window.nbytes)]
    window.close()


def test_a_device_copy_finds_the_window_its_source_lies_in_and_closing_undoes_what_it_did():
    window = SharedWindow.create(UNIT_BYTES * 4, "netoptim-test-lookup")
    undone = []
    window.before_close.append(lambda: undone.append(True))
    inside = window.bytes[UNIT_BYTES : 2 * UNIT_BYTES]
    assert window_holding(inside.data_ptr(), inside.numel()) is window
    assert window_holding(inside.data_ptr(), window.nbytes) is None, "a range past the window's end is not in it"
    assert window_holding(torch.empty(16).data_ptr(), 64) is None
    window.close()
    assert undone == [True] and window_holding(inside.data_ptr(), 1) is None


def test_a_burst_s_pages_are_given_back_once_a_period_while_steady_use_stays_resident():
    window = SharedWindow.create(64 << 20, "netoptim-test-trim")
    now = [0.0]
    writer = WindowWriter(window, clock=lambda: now[0])

    def resident_mib() -> float:
        return os.fstat(window.fd).st_blocks * 512 / 2**20

    burst = [msgpack.unpackb(writer.write(torch.ones(4 << 20), CHUNK))[0] for _ in range(2)]  # 2 x 16 MiB
    writer.credit(burst)
    assert resident_mib() >= 32, "within the period nothing is given back"
    step = torch.ones(1 << 20)  # 4 MiB, what every step moves from now on
    for _ in range(5):  # the burst's period ends, then one period of steady use
        now[0] += TRIM_PERIOD_S / 2
        writer.credit([msgpack.unpackb(writer.write(step, CHUNK))[0]])
    assert resident_mib() <= 4.1 and writer.given_back_bytes == 28 << 20, "the burst's pages above the steady 4 MiB went"
    assert int(window.bytes[(8 << 20) + 1]) == 0 and writer.lent_bytes == 0
    held = msgpack.unpackb(writer.write(step, CHUNK))[0]  # lent across the next period: kept
    now[0] += TRIM_PERIOD_S
    writer.credit([])
    assert resident_mib() >= 4 and held == 0
    window.close()


def test_a_handshake_naming_no_real_pid_is_refused_not_raised():
    peers = SharedPeers(lambda fd: None, lambda fd: None, window_bytes=UNIT_BYTES * 4)
    for pid in (2**40, -5, 0, True, "1", 1.5):  # 2**40: past a C int, which pidfd_open raises OverflowError for
        answer = msgpack.unpackb(peers.handshake(b"a", msgpack.packb({"pid": pid})))
        assert "no valid pid" in answer["refused"] and not peers.connections
    peers.close()


def test_the_shared_path_refuses_what_the_socket_path_refuses(link):
    strided = torch.zeros(1 << 16)[::2]
    with pytest.raises(ValueError, match="contiguous 1-D CPU"):
        link.client.send(tensor_header(MsgType.PUSH, torch.zeros(1 << 15), chunk_bytes=CHUNK, step=1), strided)


def test_a_payload_filled_in_a_reserved_extent_goes_with_no_copy_and_a_cancelled_one_is_free_again():
    window = SharedWindow.create(UNIT_BYTES * 8, "netoptim-test-reserve")
    writer = WindowWriter(window)
    assert writer.reserve(UNIT_BYTES - 4) is None, "a payload too small for the window goes on the socket"
    reserved = writer.reserve(2 * UNIT_BYTES)
    assert reserved is not None and reserved.data_ptr() == window.address and writer.reserved_bytes == 2 * UNIT_BYTES
    writer.credit([0])
    assert writer.lent_bytes == 2 * UNIT_BYTES, "a credit for an extent not sent yet is not the peer's to give"
    values = reserved.view(torch.float32)
    values.copy_(torch.arange(values.numel(), dtype=torch.float32))
    pieces, lengths = [values], [2 * UNIT_BYTES]
    assert writer.placed([values.clone()], lengths) is None, "a payload elsewhere is not in place"
    assert msgpack.unpackb(writer.placed(pieces, lengths)) == [0, lengths] and writer.reserved_bytes == 0
    assert writer.written_bytes == 2 * UNIT_BYTES and writer.placed(pieces, lengths) is None, "sent once"
    other = writer.reserve(4 * UNIT_BYTES)
    assert other is not None and other.data_ptr() == window.address + 2 * UNIT_BYTES
    assert writer.reserve(4 * UNIT_BYTES) is None, "no room"
    writer.cancel(other)
    writer.cancel(other)  # twice: ignored
    writer.credit([0])
    assert writer.lent_bytes == 0 and writer._free == [(0, window.nbytes)]
    window.close()


def test_a_payload_filled_in_place_reaches_the_node_bitwise(link):
    writer = link.client.shared.connection.writer
    values = torch.randn(1 << 18)
    reserved = link.client.reserve(values.numel() * 4)
    assert reserved is not None
    reserved.view(torch.float32).copy_(values)
    got = link.push(reserved.view(torch.float32))
    assert torch.equal(joined(got), values) and writer.written_bytes == values.numel() * 4
    del got
    link.server.recv(0.05)
    link.client.recv(0.05)
    assert writer.lent_bytes == 0, "the node credits it back like any other extent"


def test_a_node_sizes_the_window_for_what_workers_send_and_keeps_the_other_way():
    peers = SharedPeers(lambda fd: None, lambda fd: None, window_bytes=UNIT_BYTES * 4)
    peers.size_inboxes(UNIT_BYTES * 10 + 1)
    answer = msgpack.unpackb(peers.handshake(b"a", msgpack.packb({"pid": os.getpid()})))
    assert answer["write_bytes"] == UNIT_BYTES * 15 and answer["bytes"] == UNIT_BYTES * 4, "a step's gradients and a window to spare"
    connection = peers.connections[b"a"]
    assert connection.reader.window.nbytes == UNIT_BYTES * 15 and connection.writer.window.nbytes == UNIT_BYTES * 4
    peers.size_inboxes(0)
    assert peers.inbox_bytes == UNIT_BYTES * 4, "never less than the window each way"
    peers.close()


@pytest.mark.parametrize("how", ["peer locks", "locked here"])
def test_pages_a_device_may_have_locked_are_never_given_back(how):
    """A GPU's page-locked copies keep using the pages they locked: pages given back and faulted in
    again would be other pages, so the device and the processes would no longer share the bytes."""
    window = SharedWindow.create(64 << 20, "netoptim-test-keep")
    now = [0.0]
    writer = WindowWriter(window, clock=lambda: now[0])
    if how == "peer locks":
        writer.keep_resident = True
    else:
        window.page_locked = True  # what gpu_worker.layerwise.device_copy.page_locked records once CUDA locked it
    writer.credit([msgpack.unpackb(writer.write(torch.ones(4 << 20), CHUNK))[0]])  # a 16 MiB burst
    for _ in range(4):
        now[0] += TRIM_PERIOD_S
        writer.credit([msgpack.unpackb(writer.write(torch.ones(1 << 10), CHUNK))[0]])
    assert writer.given_back_bytes == 0 and os.fstat(window.fd).st_blocks * 512 >= 16 << 20
    window.close()


def test_a_worker_that_may_lock_its_windows_keeps_the_node_from_giving_back_their_pages():
    peers = SharedPeers(lambda fd: None, lambda fd: None, window_bytes=UNIT_BYTES * 4)
    for locks, kept in ((True, True), (False, False), (None, True)):
        request = {"pid": os.getpid()} | ({} if locks is None else {"locks": locks})
        peers.handshake(b"a", msgpack.packb(request))
        assert peers.connections[b"a"].writer.keep_resident is kept, request
    peers.close()
