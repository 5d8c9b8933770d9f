"""One state file version on its own: the checksum, the buffers, and direct and buffered reads and
writes of every size, including the parts that are not whole blocks."""

from __future__ import annotations

import os

import pytest
import torch
import xxhash

from optimizer_node.ooc_files import ALIGN, HUGE_PAGE, describe_file, digest, probe_direct_io, read_checked, state_buffer, state_digests, write_version
from optimizer_node.storage import StorageError


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
