"""The out-of-core store on real files: the budget, write-behind, hard-linked checkpoints, and files
that change under it, in each I/O mode: buffered, ``sync`` (O_DIRECT where the file system takes
it), and ``sync`` through the page cache (where it does not); in each, retired versions' files are
reused."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import zlib

import pytest
import torch
import xxhash

from optimizer_node.state import ooc_files
from optimizer_node.state.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from optimizer_node.state.ooc_store import OutOfCoreStore
from optimizer_node.state.storage import InMemoryStore, StorageError
from optimizer_node.update.adamw import AdamWHyper, adamw_update

NUMEL = 1024
BUCKET_BYTES = 12 * NUMEL


@pytest.fixture(params=["buffered", "sync", "sync-page-cache"])
def io(request, monkeypatch) -> str:
    if request.param == "sync-page-cache":  # a file system without O_DIRECT
        monkeypatch.setattr("optimizer_node.state.ooc_store.probe_direct_io", lambda directory: False)
    return request.param


def open_store(state_dir, budget: int, io: str) -> OutOfCoreStore:
    return OutOfCoreStore(state_dir, budget, sync=io != "buffered")


def filled(store: OutOfCoreStore, count: int) -> None:
    for bucket_id in range(count):
        store.create(bucket_id, torch.full((NUMEL,), float(bucket_id)))


def update(store: OutOfCoreStore, bucket_id: int, value: float) -> None:
    state = store.get(bucket_id)
    store.acquire(state)
    state.param.add_(value)
    state.exp_avg.fill_(value)
    state.step += 1
    store.release(state, dirty=True)


def test_state_survives_eviction_and_memory_stays_within_the_budget(tmp_path, io):
    store = open_store(tmp_path / "state", 3 * BUCKET_BYTES, io)
    filled(store, 10)
    for _step in range(3):
        for bucket_id in range(10):
            store.prefetch((bucket_id + 1) % 10)
            update(store, bucket_id, 1.0)
            assert store.resident_bytes() <= 3 * BUCKET_BYTES
    for bucket_id in range(10):
        state = store.get(bucket_id)
        store.acquire(state)
        assert torch.all(state.param == bucket_id + 3.0) and torch.all(state.exp_avg == 1.0) and state.step == 3
        store.release(state, dirty=False)
    assert store.bytes_written > 0 and store.bytes_read > 0
    assert len(list((tmp_path / "state").glob("bucket-*.bin"))) == 10, "one file per bucket: old versions are removed"
    store.close()


def test_a_state_that_fits_the_budget_is_never_written(tmp_path):
    store = OutOfCoreStore(tmp_path / "state", 100 * BUCKET_BYTES)
    filled(store, 4)
    for bucket_id in range(4):
        update(store, bucket_id, 1.0)
    assert store.bytes_written == 0 and store.resident_bytes() == 4 * BUCKET_BYTES
    store.close()


def test_checkpoints_hard_link_the_state_files(tmp_path, io):
    store = open_store(tmp_path / "state", 2 * BUCKET_BYTES, io)
    filled(store, 4)
    for bucket_id in range(4):
        update(store, bucket_id, 2.0)
    manifest = write_checkpoint(tmp_path / "checkpoints", step=1, states=list(store), meta={}, keep=2, write_file=store.write_checkpoint_file)
    checkpoint = read_checkpoint(tmp_path / "checkpoints" / "step-0000000001")
    for name in manifest["files"]:
        linked = tmp_path / "checkpoints" / "step-0000000001" / name
        live = next((tmp_path / "state").glob(f"{name.removesuffix('.bin')}.v*.bin"))
        assert os.stat(linked).st_ino == os.stat(live).st_ino, "a checkpoint is a hard link, not a copy"
    assert torch.all(checkpoint.buckets[3].param == 5.0)
    update(store, 3, 1.0)  # the next version goes to a new file: the checkpoint keeps its values
    store.poll()
    assert torch.all(read_checkpoint(tmp_path / "checkpoints" / "step-0000000001").buckets[3].param == 5.0)
    restored = open_store(tmp_path / "restored", 2 * BUCKET_BYTES, io)
    for bucket_id, snapshot in checkpoint.buckets.items():
        restored.restore(bucket_id, snapshot.step, snapshot.step_tensor, snapshot.path, snapshot.numel)
    state = restored.get(2)
    restored.acquire(state)
    assert torch.all(state.param == 4.0) and torch.all(state.exp_avg == 2.0) and state.step == 1
    store.close()
    restored.close()


def test_an_out_of_core_checkpoint_is_verified_by_the_digest_its_store_recorded(tmp_path, io):
    """The manifest takes the store's own XXH3 of each file (no second read at checkpoint time); a byte
    flipped in a file fails the checkpoint, and a manifest of the CRC-32 era still verifies."""
    store = open_store(tmp_path / "state", 2 * BUCKET_BYTES, io)
    filled(store, 3)
    for bucket_id in range(3):
        update(store, bucket_id, 1.0)
    root = tmp_path / "checkpoints"
    manifest = write_checkpoint(root, step=1, states=list(store), meta={}, keep=2, write_file=store.write_checkpoint_file)
    store.close()
    newest = root / "step-0000000001"
    for name, entry in manifest["files"].items():
        assert entry["xxh3_64"] == xxhash.xxh3_64_intdigest((newest / name).read_bytes()) and "crc32" not in entry
    assert read_checkpoint(newest).step == 1

    crc_era = json.loads((newest / "manifest.json").read_text())
    for name, entry in crc_era["files"].items():
        entry["crc32"] = zlib.crc32((newest / name).read_bytes())
        del entry["xxh3_64"]
    (newest / "manifest.json").write_text(json.dumps(crc_era))
    assert read_checkpoint(newest).step == 1

    bucket = newest / "bucket-000001.bin"
    data = bytearray(bucket.read_bytes())
    data[5] ^= 0x10
    bucket.unlink()  # a hard link to the store's file: write a damaged copy in its place
    bucket.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        read_checkpoint(newest)


@pytest.mark.parametrize("damage", ["truncate", "edit-keeping-size-and-mtime", "replace"])
def test_a_state_file_changed_under_the_node_is_an_error_and_the_rest_goes_on(tmp_path, damage, io):
    store = open_store(tmp_path / "state", 2 * BUCKET_BYTES, io)
    filled(store, 4)
    for bucket_id in range(4):
        update(store, bucket_id, 1.0)
    store.poll()
    victim = store.get(0)
    assert victim.param.numel() == 0, "bucket 0 was evicted to its file"
    path = next((tmp_path / "state").glob("bucket-000000.v*.bin"))
    stat = path.stat()
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[:-8])
    elif damage == "edit-keeping-size-and-mtime":
        data[100] ^= 0x10
        with open(path, "r+b") as handle:
            handle.write(data)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    else:
        path.unlink()
        path.write_bytes(data)
    with pytest.raises(StorageError, match=r"bucket 0: cannot read its state: .*(changed outside the node|checksum differs).*--resume"):
        store.acquire(victim)
    for bucket_id in (1, 2, 3):  # the other buckets are unaffected
        update(store, bucket_id, 1.0)
    store.close()


def test_an_unwritable_state_directory_is_refused_at_start(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file, not a directory")
    with pytest.raises(StorageError, match=r"cannot use .* as the state directory.*writable"):
        OutOfCoreStore(blocked / "state", BUCKET_BYTES)


@pytest.fixture
def small_disk(tmp_path):
    """A real 256 KiB filesystem."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=False)


def test_a_full_disk_keeps_the_values_in_memory_and_training_goes_on_once_there_is_room(small_disk, io):
    filler = small_disk / "filler"
    filler.write_bytes(b"x" * (256 * 1024 - 2 * BUCKET_BYTES))  # room for two state files
    store = open_store(small_disk / "state", 2 * BUCKET_BYTES, io)
    filled(store, 2)
    with pytest.raises(StorageError, match=r"cannot write its state .*No space left on device.*free space"):
        for bucket_id in range(2, 6):  # each needs room: the write-backs of the others fill the disk
            store.create(bucket_id, torch.full((NUMEL,), float(bucket_id)))
    created = len(store)
    filler.unlink()  # the operator frees space
    for bucket_id in range(created, 6):
        store.create(bucket_id, torch.full((NUMEL,), float(bucket_id)))
    for bucket_id in range(6):  # nothing was lost
        state = store.get(bucket_id)
        store.acquire(state)
        assert torch.all(state.param == float(bucket_id)), bucket_id
        store.release(state, dirty=False)
    store.close()


def test_writes_reuse_the_retired_versions_file_but_never_a_checkpointed_one(tmp_path, io):
    store = open_store(tmp_path / "state", 2 * BUCKET_BYTES, io)
    filled(store, 4)

    def inode(bucket_id: int) -> int:
        (path,) = (tmp_path / "state").glob(f"bucket-{bucket_id:06d}.v*.bin")
        return path.stat().st_ino

    for bucket_id in range(4):
        update(store, bucket_id, 1.0)
    store.flush()
    first = [inode(bucket_id) for bucket_id in range(4)]
    for bucket_id in range(4):
        update(store, bucket_id, 1.0)
    store.flush()
    assert [inode(bucket_id) for bucket_id in range(4)] == first, "each next version overwrote the retired one's file"
    write_checkpoint(tmp_path / "checkpoints", step=2, states=list(store), meta={}, keep=2, write_file=store.write_checkpoint_file)
    update(store, 3, 1.0)
    store.flush()
    after_checkpoint = inode(3)
    assert after_checkpoint != first[3], "a checkpoint links the old file: the next version is a new one"
    assert torch.all(read_checkpoint(tmp_path / "checkpoints" / "step-0000000002").buckets[3].param == 5.0)
    update(store, 3, 1.0)
    store.flush()
    assert inode(3) == after_checkpoint and len(list((tmp_path / "state").glob("bucket-*.bin"))) == 4
    state = store.get(3)
    store.acquire(state)
    assert torch.all(state.param == 7.0) and state.step == 4
    store.release(state, dirty=False)
    store.close()


@pytest.mark.parametrize("numel", [100, 1000, 1100, 3 << 18])  # below a block, a partial last block, whole huge pages
def test_odd_sized_buckets_and_parameter_fetches_round_trip(tmp_path, io, numel):
    store = open_store(tmp_path / "state", 2 * 12 * numel, io)
    values = [torch.randn(numel, generator=torch.Generator().manual_seed(bucket_id)) for bucket_id in range(4)]
    for bucket_id, value in enumerate(values):
        store.create(bucket_id, value)
    store.flush()
    for bucket_id, value in enumerate(values):  # evicted ones: only their parameter third is read
        assert torch.equal(store.params_for_send(store.get(bucket_id)), value), bucket_id
    for bucket_id, value in enumerate(values):
        state = store.get(bucket_id)
        store.acquire(state)
        assert torch.equal(state.param, value) and torch.all(state.exp_avg == 0) and torch.all(state.exp_avg_sq == 0)
        store.release(state, dirty=False)
    store.close()


def test_adamw_out_of_core_is_bitwise_equal_to_in_memory(tmp_path, io):
    numel, buckets = 1100, 6
    hyper = AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.01)
    stores = [InMemoryStore(), open_store(tmp_path / "state", 2 * 12 * numel, io)]
    for store in stores:
        for bucket_id in range(buckets):
            store.create(bucket_id, torch.randn(numel, generator=torch.Generator().manual_seed(bucket_id)))
    for step in range(4):
        for bucket_id in range(buckets):
            grad = torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + bucket_id))
            for store in stores:
                store.prefetch((bucket_id + 1) % buckets)
                state = store.get(bucket_id)
                store.acquire(state)
                adamw_update(state.param, grad.clone(), state.exp_avg, state.exp_avg_sq, state.step_tensor, hyper)
                state.step += 1
                store.release(state, dirty=True)
                store.poll()
    memory, out_of_core = stores
    for bucket_id in range(buckets):
        expected, state = memory.get(bucket_id), out_of_core.get(bucket_id)
        out_of_core.acquire(state)
        for name in ("param", "exp_avg", "exp_avg_sq", "step_tensor"):
            assert torch.equal(getattr(state, name), getattr(expected, name)), (bucket_id, name)
        out_of_core.release(state, dirty=False)
    out_of_core.close()


def test_a_failed_write_in_place_keeps_the_values_and_the_next_write_goes_to_a_new_file(tmp_path, monkeypatch, io):
    store = open_store(tmp_path / "state", 2 * BUCKET_BYTES, io)
    filled(store, 4)
    store.flush()
    pwrite = os.pwrite
    failures = []

    def failing_once(fd, data, offset):  # every write of a state file, direct or through the page cache
        if not failures:
            failures.append(fd)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return pwrite(fd, data, offset)

    monkeypatch.setattr(ooc_files.os, "pwrite", failing_once)
    update(store, 0, 1.0)  # its retired version's file is taken over and the write fails
    store.flush()
    assert failures and "Input/output error" in store.last_error
    assert not list((tmp_path / "state").glob("bucket-000000.v*.bin")), "the torn file is removed"
    update(store, 0, 1.0)  # the next write of bucket 0: to a new file
    store.flush()
    assert len(list((tmp_path / "state").glob("bucket-000000.v*.bin"))) == 1
    state = store.get(0)
    assert state.param.numel() == 0, "bucket 0 was written and evicted"
    store.acquire(state)
    assert torch.all(state.param == 2.0) and torch.all(state.exp_avg == 1.0) and state.step == 2
    store.release(state, dirty=False)
    store.close()


def test_a_budget_too_small_to_overlap_the_io_is_said_at_registration(tmp_path, caplog):
    store = OutOfCoreStore(tmp_path / "state", 3 * 12 * 1024)
    try:
        with caplog.at_level("WARNING", logger="optimizer_node.state.ooc_store"):
            store.expect_buckets([512] * 100)  # 16 buckets' worth of the largest: room to overlap
            assert not caplog.records
            store.expect_buckets([1024] * 10)  # holds fewer than 4 of them
            assert "holds fewer than 4 of this job's largest buckets" in caplog.text and "smaller bucket_numel" in caplog.text
            caplog.clear()
            store.expect_buckets([1024] * 2)  # the whole state fits: nothing to overlap
            assert not caplog.records
    finally:
        store.close()
