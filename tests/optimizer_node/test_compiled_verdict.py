"""The compiled loop's bitwise check runs once per build and CPU: its verdict is on record beside
numba's cache under a fingerprint of what it depends on."""

from __future__ import annotations

import json

import pytest

from optimizer_node.update.kernels import compiled_cache

pytest.importorskip("numba")


def test_a_verdict_is_on_record_for_its_build_only_and_a_damaged_record_means_check_again(tmp_path):
    source = tmp_path / "loop.py"
    source.write_text("x = 1\n")
    fingerprint = compiled_cache.build_fingerprint([source])
    assert fingerprint == compiled_cache.build_fingerprint([source]), "the same build, the same fingerprint"
    records = tmp_path / "cache"
    assert compiled_cache.recorded_verdict(records, fingerprint) == (False, None)
    compiled_cache.record_verdict(records, fingerprint, None)
    assert compiled_cache.recorded_verdict(records, fingerprint) == (True, None)
    source.write_text("x = 2\n")  # another loop: checked again
    changed = compiled_cache.build_fingerprint([source])
    assert changed != fingerprint and compiled_cache.recorded_verdict(records, changed) == (False, None)
    compiled_cache.record_verdict(records, changed, "the bf16 cast")
    assert compiled_cache.recorded_verdict(records, changed) == (True, "the bf16 cast")
    assert compiled_cache.recorded_verdict(records, fingerprint) == (False, None), "only the latest build is kept"
    (records / compiled_cache.VERDICT_FILE).write_text("{not json")
    assert compiled_cache.recorded_verdict(records, changed) == (False, None)
    (records / compiled_cache.VERDICT_FILE).write_text(json.dumps({changed: 3}))
    assert compiled_cache.recorded_verdict(records, changed) == (False, None), "a verdict is a difference named, or none"
    blocked = tmp_path / "file"
    blocked.write_text("")
    compiled_cache.record_verdict(blocked / "cache", fingerprint, None)  # nowhere to write: no error
