"""One state file version on its own: the checksum, the buffers, and direct and buffered reads and
writes of every size, including the parts that are not whole blocks."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import xxhash

from optimizer_node.state import ooc_files
from optimizer_node.state.ooc_files import (
    ALIGN,
    HUGE_PAGE,
    _pieces,
    describe_file,
    digest,
    probe_direct_io,
    read_checked,
    state_buffer,
    state_digests,
    write_version,
)
from optimizer_node.state.storage import StorageError


@pytest.mark.parametrize("length", [0, 1, 3, 4096, 12345, (3 << 20) + 12])
def test_state_digests_are_xxh3_of_the_whole_and_of_the_parameter_third(length):
    data = os.urandom(length)
    whole, param = state_digests(memoryview(data))
    assert whole == digest(data) == xxhash.xxh3_64_intdigest(data)
    assert param == xxhash.xxh3_64_intdigest(data[: length // 3])
    if length:
        flipped = bytearray(data)
        flipped[length // 2] ^= 1
        assert digest(bytes(flipped)) != whole


@pytest.mark.parametrize("numel", [1, 1000, 3 << 18, (3 << 18) + 5])
def test_state_buffers_are_aligned_for_direct_io_and_start_on_a_huge_page_when_they_span_one(numel):
    buffer = state_buffer(numel)
    assert buffer.numel() == numel and buffer.dtype == torch.float32 and buffer.data_ptr() % ALIGN == 0
    if 4 * numel >= HUGE_PAGE:
        assert buffer.data_ptr() % HUGE_PAGE == 0
    buffer.fill_(2.0)
    assert torch.all(buffer == 2.0)


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("numel", [100, 1024, 1100, 1 << 18, (3 << 18) + 5])  # 1 << 18: a parameter third of 1 MiB
def test_a_version_reads_back_as_written_and_an_overwrite_keeps_the_file(tmp_path, direct, numel):
    if direct and not probe_direct_io(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    flat = state_buffer(3 * numel)
    flat.copy_(torch.randn(3 * numel, generator=torch.Generator().manual_seed(numel)))
    path = tmp_path / "bucket.bin"
    info = write_version(path, flat, 1, sync=True, direct=direct, overwrite=False)
    written = path.read_bytes()
    assert info.size == 12 * numel and info.digest == digest(written) and info.param_digest == digest(written[: 4 * numel])
    assert describe_file(path, 1, param_bytes=4 * numel) == info  # a checkpoint's file, adopted, gets the same digests
    into = state_buffer(3 * numel)
    read_checked(path, into, info, expected_digest=info.digest, sync=True, direct=direct)
    assert torch.equal(into, flat)
    param = state_buffer(numel)
    read_checked(path, param, info, expected_digest=info.param_digest, sync=True, direct=direct)
    assert torch.equal(param, flat[:numel])

    flat.add_(1.0)
    again = write_version(path, flat, 2, sync=True, direct=direct, overwrite=True)
    assert again.inode == info.inode and again.size == info.size and again.digest != info.digest
    read_checked(path, into, again, expected_digest=again.digest, sync=True, direct=direct)
    assert torch.equal(into, flat)
    with pytest.raises(StorageError, match="changed outside the node"):
        read_checked(path, into, info, expected_digest=info.digest, sync=True, direct=direct)


def test_a_buffer_that_is_not_aligned_goes_through_the_page_cache(tmp_path):
    flat = torch.randn(3 * 1024 + 1)[1:]  # 4 bytes past an allocation's start
    assert flat.data_ptr() % ALIGN
    path = tmp_path / "bucket.bin"
    info = write_version(path, flat, 1, sync=True, direct=True, overwrite=False)
    into = torch.empty(3 * 1024 + 1)[1:]
    read_checked(path, into, info, expected_digest=info.digest, sync=True, direct=True)
    assert torch.equal(into, flat)


@pytest.mark.parametrize(("length", "piece", "cut"), [(0, 8, 0), (5, 8, 1), (24, 8, 8), (25, 8, 8), (100, 8, 33), (3 << 20, 1 << 20, 1 << 20)])
def test_buffered_io_pieces_tile_the_file_and_one_ends_at_the_parameter_third(length, piece, cut):
    pieces = _pieces(length, piece, cut)
    bounds = [0, *(stop for _, stop in pieces)]
    assert pieces == list(itertools.pairwise(bounds)) and bounds[-1] == length  # contiguous, from 0 to the end
    assert all(0 < stop - start <= piece for start, stop in pieces)
    assert cut == 0 or any(stop == cut for _, stop in pieces)


def test_a_buffered_version_hashes_what_it_wrote_and_what_it_read_across_pieces(tmp_path, monkeypatch):
    numel = (3 << 16) + 7  # small pieces below: many of them, the parameter third inside one
    monkeypatch.setattr(ooc_files, "READ_PIECE", 4096)
    monkeypatch.setattr(ooc_files, "WRITE_PIECE", 12288)
    flat = state_buffer(3 * numel)
    flat.copy_(torch.randn(3 * numel, generator=torch.Generator().manual_seed(3)))
    path = tmp_path / "bucket.bin"
    info = write_version(path, flat, 1, sync=False, direct=False, overwrite=False)
    written = path.read_bytes()
    assert written == flat.numpy().tobytes()
    assert (info.digest, info.param_digest) == (xxhash.xxh3_64_intdigest(written), xxhash.xxh3_64_intdigest(written[: 4 * numel]))
    into = state_buffer(3 * numel)
    read_checked(path, into, info, expected_digest=info.digest, sync=False, direct=False)
    assert torch.equal(into, flat)
    with path.open("r+b") as handle:  # one bit flipped in a later piece, size and times kept
        handle.seek(len(written) - 5000)
        handle.write(bytes([written[-5000] ^ 1]))
    os.utime(path, ns=(info.mtime_ns, info.mtime_ns))
    with pytest.raises(StorageError, match="checksum differs"):
        read_checked(path, into, info, expected_digest=info.digest, sync=False, direct=False)
