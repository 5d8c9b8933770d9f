"""StepHeap against glibc's real heap, in a fresh interpreter each (so that the heap is that program's
alone): freed memory within the slack stays resident for the next step; a creep past it is trimmed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from transport.host_memory import StepHeap

PROGRAM = r"""
import json, sys
from transport.host_memory import StepHeap, resident_bytes

heap = StepHeap(slack_bytes=8 << 20, settle_steps=1)
first = heap.step_done()  # the mark
blocks = [bytearray(b"\x01") * (64 << 10) for _ in range(int(sys.argv[1]))]  # 64 KiB each: heap, not mapped
del blocks[::2]  # holes between the kept ones: freed but not at the top, so glibc keeps them resident
before = resident_bytes()
trimmed = heap.step_done()
print(json.dumps({"first": first, "trimmed": trimmed, "freed_resident": before, "after": resident_bytes(), "trims": heap.trims}))
"""


def run(blocks: int) -> dict:
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(blocks)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_a_creep_past_the_slack_is_trimmed():
    result = run(1024)  # 64 MiB, 32 of it freed in holes
    assert not result["first"]
    assert result["trimmed"] and result["trims"] == 1
    assert result["after"] < result["freed_resident"] - (16 << 20), result


def test_freed_memory_within_the_slack_stays_for_the_next_step():
    result = run(64)  # 4 MiB, under the 8 MiB slack
    assert not result["first"] and not result["trimmed"] and result["trims"] == 0
    assert result["after"] >= result["freed_resident"] - (1 << 20), result


def test_a_negative_slack_or_no_settling_step_is_refused():
    with pytest.raises(ValueError, match="slack_bytes"):
        StepHeap(slack_bytes=-1)
    with pytest.raises(ValueError, match="settle_steps"):
        StepHeap(settle_steps=0)
