"""StepHeap against glibc's real heap, in a fresh interpreter each (so that the heap is that program's
alone): freed memory within the slack stays resident for the next step; a creep past it is trimmed;
what the first steps grow, while the heap settles, is not."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from transport.host_memory import StepHeap

PROGRAM = r"""
import json, sys
from transport.host_memory import StepHeap, resident_bytes

blocks_freed, settle_steps, holes_before = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
heap = StepHeap(slack_bytes=8 << 20, settle_steps=settle_steps)
steps = []
for step in range(settle_steps + 1):
    if step == holes_before:
        blocks = [bytearray(b"\x01") * (64 << 10) for _ in range(blocks_freed)]  # 64 KiB each: heap, not mapped
        del blocks[::2]  # holes between the kept ones: freed but not at the top, so glibc keeps them resident
    before = resident_bytes()
    steps.append({"trimmed": heap.step_done(), "before": before, "after": resident_bytes()})
print(json.dumps({"steps": steps, "trims": heap.trims}))
"""


def run(blocks_freed: int, *, settle_steps: int = 1, holes_before: int = 1) -> dict:
    args = [str(blocks_freed), str(settle_steps), str(holes_before)]
    done = subprocess.run([sys.executable, "-c", PROGRAM, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_a_creep_past_the_slack_is_trimmed():
    result = run(1024)  # 64 MiB after the mark, 32 of it freed in holes
    mark, last = result["steps"]
    assert not mark["trimmed"]
    assert last["trimmed"] and result["trims"] == 1
    assert last["after"] < last["before"] - (16 << 20), result


def test_freed_memory_within_the_slack_stays_for_the_next_step():
    result = run(64)  # 4 MiB, under the 8 MiB slack
    assert result["trims"] == 0
    last = result["steps"][-1]
    assert last["after"] >= last["before"] - (1 << 20), result


def test_what_the_settling_steps_grow_is_not_trimmed():
    result = run(1024, settle_steps=3, holes_before=1)  # the 64 MiB come before the mark is set
    assert result["trims"] == 0, result
    assert result["steps"][-1]["before"] >= result["steps"][0]["before"] + (16 << 20), "the holes stayed resident"


def test_a_negative_slack_or_no_settling_step_is_refused():
    with pytest.raises(ValueError, match="slack_bytes"):
        StepHeap(slack_bytes=-1)
    with pytest.raises(ValueError, match="settle_steps"):
        StepHeap(settle_steps=0)


KEEP_PROGRAM = r"""
import json, os, sys
from transport.host_memory import keep_freed_heap, map_large_allocations

statm = os.open("/proc/self/statm", os.O_RDONLY)
page = os.sysconf("SC_PAGE_SIZE")


def resident() -> int:  # read into a small object (Python's own pools, not the heap): nothing lands above the block
    return int(os.pread(statm, 64, 0).split()[1]) * page


assert map_large_allocations(32 << 20) and keep_freed_heap(int(sys.argv[1]))
block = bytearray(b"\x01") * (16 << 20)  # from the heap's top (under the 32 MiB threshold), every page touched
held = resident()
del block  # freed at the top of the heap: kept if the trim threshold is above 16 MiB
after = resident()
print(json.dumps({"held": held, "after": after}))
"""


@pytest.mark.parametrize("kept", [64 << 20, 4 << 30, 6 << 30])
def test_a_kept_heap_of_2_gib_or_more_is_kept_not_wrapped_to_nothing(kept):
    """mallopt takes a C int: 4 GiB used to wrap around to 0, a trim at every free."""
    done = subprocess.run([sys.executable, "-c", KEEP_PROGRAM, str(kept)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["after"] >= result["held"] - (1 << 20), result
