"""The out-of-core store on real files: the budget, write-behind, hard-linked checkpoints, and files
that change under it."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from optimizer_node.checkpoint import read_checkpoint, write_checkpoint
from optimizer_node.ooc_store import OutOfCoreStore
from optimizer_node.storage import StorageError

NUMEL = 1024
BUCKET_BYTES = 12 * NUMEL


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


def test_state_survives_eviction_and_memory_stays_within_the_budget(tmp_path):
    store = OutOfCoreStore(tmp_path / "state", 3 * BUCKET_BYTES)
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


def test_checkpoints_hard_link_the_state_files(tmp_path):
    store = OutOfCoreStore(tmp_path / "state", 2 * BUCKET_BYTES)
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
    restored = OutOfCoreStore(tmp_path / "restored", 2 * BUCKET_BYTES)
    for bucket_id, snapshot in checkpoint.buckets.items():
        restored.restore(bucket_id, snapshot.step, snapshot.step_tensor, snapshot.path, snapshot.numel)
    state = restored.get(2)
    restored.acquire(state)
    assert torch.all(state.param == 4.0) and torch.all(state.exp_avg == 2.0) and state.step == 1
    store.close()
    restored.close()


@pytest.mark.parametrize("damage", ["truncate", "edit-keeping-size-and-mtime", "replace"])
def test_a_state_file_changed_under_the_node_is_an_error_and_the_rest_goes_on(tmp_path, damage):
    store = OutOfCoreStore(tmp_path / "state", 2 * BUCKET_BYTES)
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


def test_a_full_disk_keeps_the_values_in_memory_and_training_goes_on_once_there_is_room(small_disk):
    filler = small_disk / "filler"
    filler.write_bytes(b"x" * (256 * 1024 - 2 * BUCKET_BYTES))  # room for two state files
    store = OutOfCoreStore(small_disk / "state", 2 * BUCKET_BYTES)
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
