"""Checkpoint files: written atomically, verified on read, damaged ones skipped."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from optimizer_node.state.checkpoint import LATEST, CheckpointError, list_checkpoints, read_checkpoint, read_latest, write_checkpoint
from optimizer_node.state.storage import InMemoryStore


def store_at(step: int, sizes=(100, 37)) -> InMemoryStore:
    store = InMemoryStore()
    for bucket_id, numel in enumerate(sizes):
        state = store.create(bucket_id, torch.arange(numel, dtype=torch.float32) + step)
        state.exp_avg.fill_(0.5 * step)
        state.exp_avg_sq.fill_(0.25 * step)
        state.step_tensor.fill_(step)
        state.step = step
    return store


def write(root: Path, step: int, keep: int = 3, origin: str = "automatic") -> dict:
    store = store_at(step)
    meta = {"job": {}, "node_index": 0, "overrides": {}, "origin": origin}
    return write_checkpoint(root, step=step, states=list(store), meta=meta, keep=keep, write_file=store.write_checkpoint_file)


def test_round_trip_and_latest_pointer(tmp_path):
    manifest = write(tmp_path, 4)
    assert set(manifest["files"]) == {"bucket-000000.bin", "bucket-000001.bin"}
    assert (tmp_path / LATEST).read_text() == "step-0000000004"
    checkpoint = read_checkpoint(tmp_path / "step-0000000004")
    assert checkpoint.step == 4
    original = store_at(4).get(1)
    restored = checkpoint.buckets[1]
    assert torch.equal(restored.param, original.param) and torch.equal(restored.values()[2 * 37 :], original.exp_avg_sq)
    assert restored.step == 4 and restored.step_tensor == 4.0


def test_keep_prunes_old_checkpoints(tmp_path):
    for step in range(1, 6):
        write(tmp_path, step, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000000005", "step-0000000004"]


def test_keep_never_prunes_checkpoints_taken_by_hand(tmp_path):
    for step in range(1, 7):
        write(tmp_path, step, keep=2, origin="manual" if step in (1, 3) else "automatic")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000000006", "step-0000000005", "step-0000000003", "step-0000000001"]


def test_per_segment_step_counts_round_trip(tmp_path):
    store = store_at(3)
    store.get(0).segment_steps = [3.0, 1.0]
    write_checkpoint(tmp_path, step=3, states=list(store), meta={"job": {}, "node_index": 0}, keep=1, write_file=store.write_checkpoint_file)
    restored = read_checkpoint(tmp_path / "step-0000000003").buckets
    assert restored[0].segment_steps == [3.0, 1.0] and restored[1].segment_steps is None


@pytest.mark.parametrize("damage", ["flip-a-byte", "truncate", "no-manifest", "garbage-manifest"])
def test_damaged_checkpoint_is_skipped_for_the_previous(tmp_path, damage, caplog):
    write(tmp_path, 1)
    write(tmp_path, 2)
    newest = tmp_path / "step-0000000002"
    bucket = newest / "bucket-000000.bin"
    if damage == "flip-a-byte":
        data = bytearray(bucket.read_bytes())
        data[17] ^= 0x40
        bucket.write_bytes(bytes(data))
    elif damage == "truncate":
        bucket.write_bytes(bucket.read_bytes()[:-4])
    elif damage == "no-manifest":
        (newest / "manifest.json").unlink()
    else:
        (newest / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError):
        read_checkpoint(newest)
    latest = read_latest(tmp_path)
    assert latest is not None and latest.step == 1
    assert "skipping checkpoint step-0000000002" in caplog.text


def test_unwritable_directory_is_a_clear_error(tmp_path):
    if os.geteuid() == 0:
        target = Path("/proc/netoptim-checkpoints")  # not writable even for root
    else:
        target = tmp_path / "ro"
        target.mkdir()
        target.chmod(0o500)
    with pytest.raises(CheckpointError, match="cannot write checkpoint of step 3"):
        write(target, 3)


def test_buckets_at_different_steps_are_refused(tmp_path):
    store = store_at(2)
    states = list(store)
    states[1].step = 3
    with pytest.raises(CheckpointError, match="between steps"):
        write_checkpoint(tmp_path, step=2, states=states, meta={}, keep=3, write_file=store.write_checkpoint_file)
    assert list_checkpoints(tmp_path) == [] and not list(tmp_path.glob(".tmp-*"))


def test_a_manifest_entry_without_a_checksum_is_refused(tmp_path):
    write(tmp_path, 1)
    directory = tmp_path / "step-0000000001"
    manifest = json.loads((directory / "manifest.json").read_text())
    del manifest["files"]["bucket-000000.bin"]["sha256"]
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"bucket-000000\.bin has no checksum"):
        read_checkpoint(directory)
