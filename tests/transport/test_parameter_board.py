"""The node's parameter board: values published once per version, read in place by every same-host
worker that mapped it, read-only to them, and copies through the windows whenever it cannot be used."""

from __future__ import annotations

import mmap
import os
import time

import msgpack
import pytest
import torch
import zmq

from tests.transport.test_shared_windows import CHUNK, Link, joined
from transport.shm import window as shm_window
from transport.shm.board import SLOT_HEADER_BYTES, BoardPublisher, BoardReader, board_bytes, slot_bytes
from transport.shm.same_host import BOARD, HANDSHAKE, SharedClient
from transport.shm.window import SHMEM_HUGE_ON_ADVICE, shared_huge_pages, shared_pages_said
from transport.wire import ErrorCode, Header, MsgType, WireError, encode_header, tensor_header
from transport.zeromq.backend import ZmqTransport


def _settle(link: Link) -> None:
    """Let the board offer and the worker's answer cross (both ride on messages of the test)."""
    link.server.send(link.peer, _status())
    assert link.client.recv(10) is not None
    link.server.recv(0.3)


def _status() -> Header:
    return Header(msg_type=MsgType.STATUS)


def published(link: Link, values: torch.Tensor, key: int, version: int):
    header = tensor_header(MsgType.PARAMS, values, chunk_bytes=CHUNK, bucket_id=key, step=version)
    link.server.send_published(link.peer, header, values, key, version)
    message = link.client.recv(10)
    assert message is not None and message.header.bucket_id == key
    return message


@pytest.fixture
def board_link(tmp_path):
    pair = Link(tmp_path)
    assert pair.server.publish_board(board_bytes([4 << 20] * 4))
    _settle(pair)
    yield pair
    pair.close()


def test_published_values_are_read_from_the_board_in_place_and_written_once_per_version(board_link):
    link = board_link
    board = link.server._shared.board
    assert link.server._shared.connections[link.peer].board is board and link.client.shared.board is not None
    values = torch.randn(300_001)
    first = published(link, values, key=3, version=1)
    again = published(link, values, key=3, version=1)
    assert torch.equal(joined(first), values) and torch.equal(joined(again), values)
    assert first.still_current() and again.still_current()
    view = first.tensors[0][1]
    assert link.client.shared.board.window.address <= view.data_ptr() < link.client.shared.board.window.address + board.window.nbytes  # in place
    assert board.written_bytes == values.numel() * 4 and board.referenced_bytes == 2 * values.numel() * 4  # copied once, sent twice
    newer = values + 1
    latest = published(link, newer, key=3, version=2)
    assert not first.still_current() and not again.still_current()  # the slot holds another version now
    assert latest.still_current() and torch.equal(joined(latest), newer)
    assert board.written_bytes == 2 * values.numel() * 4
    snapshot = link.server.shared_memory()
    assert snapshot["board_bytes"] == board.window.nbytes and snapshot["board_referenced_bytes"] == 3 * values.numel() * 4


def test_values_written_in_place_into_a_slot_are_sent_without_a_copy(board_link):
    """The node's update pass writes a bucket's new values straight into its slot (board_slot), then
    says which version they are (board_written): sending that version copies nothing."""
    link = board_link
    board = link.server._shared.board
    values = torch.randn(300_001)
    old = published(link, values, key=4, version=1)
    slot = link.server.board_slot(4, values.numel() * 4)
    assert slot is not None and slot.numel() == values.numel() * 4
    assert not old.still_current()  # the slot holds no version while it is written
    newer = values * 2
    slot.view(torch.float32).copy_(newer)
    link.server.board_written(4, 2)
    written = board.written_bytes
    got = published(link, newer, key=4, version=2)
    assert torch.equal(joined(got), newer) and got.still_current()
    assert board.written_bytes == written  # sent from where it was written
    assert link.server.board_slot(5, 1000) is None  # under the shared-memory threshold: it goes on the socket anyway
    assert link.server.board_slot(6, 1 << 30) is None  # no room


def test_no_slot_is_given_while_no_peer_reads_the_board(tmp_path):
    pair = Link(tmp_path)
    try:
        assert pair.server.publish_board(board_bytes([4 << 20]))
        assert pair.server.board_slot(0, 1 << 20) is None  # the worker has not mapped it yet
        _settle(pair)
        assert pair.server.board_slot(0, 1 << 20) is not None
    finally:
        pair.close()


def test_keys_get_slots_of_their_own_and_bf16_is_bitwise(board_link):
    link = board_link
    a, b = torch.randn(70_000).to(torch.bfloat16), torch.randn(50_000).to(torch.bfloat16)
    got_a, got_b = published(link, a, key=0, version=5), published(link, b, key=1, version=5)
    assert torch.equal(joined(got_a), a) and torch.equal(joined(got_b), b) and got_a.still_current() and got_b.still_current()


def test_a_board_without_room_and_unpublished_sends_go_through_the_window(board_link):
    link = board_link
    board = link.server._shared.board
    too_big = torch.randn((4 << 20) * 4 // 4 + 1024)
    message = published(link, too_big, key=9, version=1)
    assert message.still_current is None and torch.equal(joined(message), too_big)  # a window copy (or the socket), the worker's own
    plain = link.pull(torch.randn(20_000))
    assert plain.still_current is None
    assert board.written_bytes == 0


def test_the_board_is_read_only_to_workers_and_sealed_against_writable_mappings(board_link):
    link = board_link
    published(link, torch.randn(10_000), key=0, version=1)
    described = link.server._shared.board.describe()
    pid, fd, _name, nbytes = described
    path = f"/proc/{pid}/fd/{fd}"
    own = os.open(path, os.O_RDWR)  # the file's mode allows it, the seal does not
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(own, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.write(own, b"x")
    finally:
        os.close(own)
    reader = link.client.shared.board
    assert not reader.window.writable and reader.window.view(0, 8).readonly


def test_a_new_board_is_offered_to_connected_and_later_workers_and_the_old_one_goes(tmp_path):
    link = Link(tmp_path)
    try:
        assert link.server.publish_board(board_bytes([1 << 20]))
        _settle(link)
        first = link.server._shared.board
        assert link.server.publish_board(board_bytes([1 << 20, 1 << 20]))  # a larger job
        _settle(link)
        second = link.server._shared.board
        assert second is not first and link.client.shared.board.name == second.name
        assert link.server._shared.connections[link.peer].board is second
        later = ZmqTransport(chunk_bytes=CHUNK).connect(link.server.address)  # a worker that connects afterwards
        later.send(Header(msg_type=MsgType.QUERY, rank=1))
        query = link.server.recv(10)
        link.server.send(query.peer, _status())
        assert later.recv(10).header.msg_type == MsgType.STATUS
        link.server.recv(0.3)  # "mapped": answered with the offer
        assert later.recv(0.5) is None  # the offer, taken and answered
        link.server.recv(0.3)
        assert link.server._shared.connections[query.peer].board is second
        values = torch.randn(8192)
        header = tensor_header(MsgType.PARAMS, values, chunk_bytes=CHUNK, bucket_id=0, step=1)
        link.server.send_published(query.peer, header, values, 0, 1)
        got = later.recv(10)
        assert got.still_current() and torch.equal(joined(got), values)
        later.close()
        link.server.drop_board()
        assert link.server._shared.board is None and link.server.shared_memory()["board_bytes"] == 0
        plain = published(link, values, key=0, version=2)
        assert plain.still_current is None  # through the window again
    finally:
        link.close()


def test_a_worker_without_windows_gets_no_board_and_a_node_without_windows_has_none(tmp_path):
    link = Link(tmp_path, shared_memory=False)
    try:
        assert link.server.publish_board(board_bytes([1 << 20]))
        values = torch.randn(8192)
        assert published(link, values, key=0, version=1).still_current is None
    finally:
        link.close()
    off = ZmqTransport(chunk_bytes=CHUNK, same_host_window_bytes=0)
    server = off.bind(f"ipc://{tmp_path}/off.sock")
    try:
        assert not server.publish_board(1 << 20)
    finally:
        server.close()
        off.close()


def test_bad_board_references_are_refused_and_a_worker_cannot_send_board_frames(board_link):
    link = board_link
    reader = link.client.shared.board
    nbytes = reader.window.nbytes
    for raw, code in [
        (msgpack.packb([0, [nbytes], 1]), ErrorCode.BAD_PAYLOAD),  # past the end
        (msgpack.packb([-64, [64], 1]), ErrorCode.BAD_PAYLOAD),
        (msgpack.packb([3, [64], 1]), ErrorCode.BAD_PAYLOAD),  # not a slot's start
        (msgpack.packb([0, [64], 0]), ErrorCode.BAD_PAYLOAD),  # no version is token 0
        (msgpack.packb([0, [64]]), ErrorCode.MALFORMED),
        (b"\xc1", ErrorCode.MALFORMED),
    ]:
        with pytest.raises(WireError) as caught:
            reader.read(raw, 64)
        assert caught.value.code == code
    header = tensor_header(MsgType.PUSH, torch.zeros(16), chunk_bytes=CHUNK, bucket_id=0, step=1)
    link.client.send_raw([BOARD, encode_header(header), msgpack.packb([0, [64], 1])])
    with pytest.raises(WireError) as caught:
        link.server.recv(5)
    assert caught.value.code == ErrorCode.MALFORMED
    assert torch.equal(joined(link.push(torch.arange(5000.0))), torch.arange(5000.0))  # the node serves on


def test_a_stale_or_wrong_board_answer_is_ignored():
    publisher = BoardPublisher(board_bytes([4096]), "netoptim-test-board")
    try:
        reader = BoardReader.open(publisher.describe())
        with pytest.raises(ValueError):
            BoardReader.open([1, 2, 3])
        slot = publisher.reference("k", 1, [torch.ones(1024)], [4096])
        payload, current, _release = reader.read(slot, 4096)
        assert current() and torch.equal(torch.frombuffer(bytearray(payload), dtype=torch.float32), torch.ones(1024))
        assert publisher.reference("other", 1, [torch.ones(1024)], [4096]) is None  # full: the caller copies instead
        publisher.reference("k", 2, [torch.zeros(1024)], [4096])
        assert not current()
        reader.close()
    finally:
        publisher.close()
    assert slot_bytes(1) == SLOT_HEADER_BYTES + 64 and board_bytes([]) == 4096
    offer = msgpack.packb({"board": [os.getpid(), 999_999, "nothing", 4096]})
    client = SharedClient()
    assert client.answer(offer) is None  # no windows mapped: an offer is not taken
    assert HANDSHAKE == b"H"


def _smaps_field(address: int, field: str) -> list[str]:
    """The words after ``field:`` for this process's mapping that starts at ``address``."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            if "-" in line.split()[0] and ":" not in line.split()[0]:
                inside = int(line.split("-")[0], 16) == address
            elif inside and line.startswith(f"{field}:"):
                return line.split()[1:]
    raise AssertionError("no such mapping")


def _resident_kib(address: int) -> int:
    """Resident KiB of this process's mapping that starts at ``address``."""
    return int(_smaps_field(address, "Rss")[0])


def test_both_sides_map_the_board_asking_for_huge_pages(tmp_path, monkeypatch):
    publisher = BoardPublisher(board_bytes([4 << 20]), "netoptim-test-board")
    try:
        reader = BoardReader.open(publisher.describe())
        for window in (publisher.window, reader.window):  # VM_HUGEPAGE: the kernel may back and map it in 2 MiB pages
            assert "hg" in _smaps_field(window.address, "VmFlags")
        reader.close()
    finally:
        publisher.close()
    setting = tmp_path / "shmem_enabled"
    setting.write_text("always within_size [advise] never deny force\n")
    monkeypatch.setattr(shm_window, "SHMEM_HUGE_PAGES", str(setting))
    assert shared_huge_pages() == "advise" and shared_pages_said() == "2 MiB pages"
    setting.write_text("always within_size advise [never] deny force\n")
    assert shared_pages_said().startswith("4 KiB pages (shared memory's huge pages are 'never'")
    setting.unlink()
    assert shared_huge_pages() is None and "no transparent huge pages" in shared_pages_said()


def test_releasing_a_read_takes_the_boards_pages_out_of_the_readers_resident_size(board_link):
    link = board_link
    values = torch.randn(1 << 20)  # 4 MiB
    message = published(link, values, key=0, version=1)
    address = link.client.shared.board.window.address
    copy = joined(message).clone()
    assert _resident_kib(address) >= 4000
    message.release()
    # only the slot's partial edge pages may stay: 4 KiB ones, or where the host gives shared memory
    # huge pages, the parts of the two 2 MiB pages at its edges that lie outside it
    assert _resident_kib(address) < (4096 + 64 if shared_huge_pages() in SHMEM_HUGE_ON_ADVICE else 64)
    assert torch.equal(joined(message), copy) and message.still_current()  # the pages are the node's: read again, they come back


def test_a_board_the_worker_cannot_open_is_declined_and_a_wrong_answer_changes_nothing(board_link):
    link = board_link
    client = link.client.shared
    offer = msgpack.packb({"board": [os.getpid(), 999_999, "netoptim-board-none", 4096]})  # no such descriptor
    reply = client.answer(offer)
    assert reply is not None and reply[0] == HANDSHAKE
    answer = msgpack.unpackb(reply[1])
    assert answer["board_mapped"] is False and "could not be mapped" in answer["why"]
    assert client.board is not None  # the board it had stays
    peers = link.server._shared
    connection = peers.connections[link.peer]
    assert peers.handshake(link.peer, msgpack.packb({"board_mapped": "netoptim-board-another"})) is None
    assert connection.board is peers.board  # an answer naming another board is ignored
    assert peers.handshake(link.peer, reply[1]) is None
    assert connection.board is peers.board  # and a decline of an offer it never made too
    link.server.publish_board(board_bytes([1 << 20]))  # a new board: offered, and declined once
    assert connection.board is None and connection.board_offered == peers.board.name
    assert peers.handshake(link.peer, reply[1]) is None and connection.board_offered is None and connection.board is None
    assert peers.handshake(link.peer, msgpack.packb({"board_mapped": peers.board.name})) is None
    assert connection.board is None  # an answer after the decline is not taken: the node uses the windows


def test_a_worker_gone_before_the_offer_reaches_it_leaves_the_node_serving(board_link):
    """A worker may close right after saying it mapped its windows (a job it refuses): the board's
    offer then has nobody to go to, and the node forgets that worker's windows and serves on."""
    link = board_link
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.connect(link.server.address)
    socket.send_multipart([HANDSHAKE, msgpack.packb({"pid": os.getpid(), "board": True})])
    assert link.server.recv(0.5) is None  # the handshake: windows made, answered
    assert socket.poll(5000)
    socket.recv_multipart()
    socket.send_multipart([HANDSHAKE, msgpack.packb({"mapped": True})])
    socket.close(linger=1000)
    time.sleep(0.5)  # the node sees the connection go before it reads the last frame
    windows = len(link.server._shared.connections)
    assert link.server.recv(0.5) is None  # "mapped": the offer finds no peer
    assert len(link.server._shared.connections) == windows - 1
    assert torch.equal(joined(link.push(torch.arange(5000.0))), torch.arange(5000.0))


def test_a_worker_that_does_not_say_it_reads_boards_is_not_offered_one(board_link):
    """A worker of an earlier release asks for windows without ``"board"``: it keeps them and gets
    copies, never an offer it would take for a broken handshake."""
    link = board_link
    socket = zmq.Context.instance().socket(zmq.DEALER)
    try:
        socket.connect(link.server.address)
        socket.send_multipart([HANDSHAKE, msgpack.packb({"pid": os.getpid()})])
        assert link.server.recv(0.5) is None
        assert socket.poll(5000)
        kind, body = socket.recv_multipart()
        assert kind == HANDSHAKE and "write" in msgpack.unpackb(body)
        socket.send_multipart([HANDSHAKE, msgpack.packb({"mapped": True})])
        assert link.server.recv(0.5) is None
        assert not socket.poll(300)  # no offer
        assert sum(c.ready and c.board_offered is None and c.board is None for c in link.server._shared.connections.values()) == 1
    finally:
        socket.close(linger=0)


def test_with_two_slots_a_key_each_version_goes_beside_the_one_before_which_stays_readable():
    """What a node keeps for a rank that restarts mid-step: the version before the current one, left
    where it is, token and all (a reader of it is not disturbed), until the key's next write."""
    nbytes = 4096
    publisher = BoardPublisher(board_bytes([nbytes] * 2), "netoptim-test-double", slots_per_key=2)
    values = [torch.full((nbytes // 4,), float(v)) for v in range(4)]
    slot = publisher.open_slot("b", nbytes)
    slot.view(torch.float32).copy_(values[0])
    publisher.written("b", 0)
    assert publisher.held("b", 0) is not None and publisher.held("b", 1) is None
    first_place = publisher.held("b", 0).data_ptr()
    ref0 = msgpack.unpackb(publisher.reference("b", 0, [values[0]], [nbytes]))
    slot = publisher.open_slot("b", nbytes)  # version 1 in place, into the other slot
    assert slot.data_ptr() != first_place
    kept = publisher.held("b", 0)
    assert kept is not None and kept.data_ptr() == first_place and torch.equal(kept.view(torch.float32), values[0])
    slot.view(torch.float32).copy_(values[1])
    publisher.written("b", 1)
    assert int(publisher._tokens[ref0[0] // 8]) == ref0[2], "the version before keeps its token: its readers read on"
    assert torch.equal(publisher.held("b", 1).view(torch.float32), values[1]) and torch.equal(kept.view(torch.float32), values[0])
    written = publisher.written_bytes
    again = msgpack.unpackb(publisher.reference("b", 0, [values[0]], [nbytes]))
    assert again == ref0 and publisher.written_bytes == written, "the version before is sent from where it is"
    publisher.reference("b", 2, [values[2]], [nbytes])  # a copied version goes beside the current one too
    assert publisher.held("b", 0) is None and torch.equal(publisher.held("b", 1).view(torch.float32), values[1])
    assert torch.equal(publisher.held("b", 2).view(torch.float32), values[2])
    publisher.close()
    single = BoardPublisher(board_bytes([nbytes]), "netoptim-test-single")
    single.open_slot("b", nbytes)
    single.written("b", 0)
    assert single.held("b", 0) is None, "one slot a key: the next write goes over it, so nothing is lent out"
    single.close()
