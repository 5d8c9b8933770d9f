"""How a bucket is cut for the node's update pass (:mod:`optimizer_node.update.bucket_pass`): chunks for the
torch-ops path, blocks and segment tails for the compiled loop. A parameter's segment is cut only at
multiples of ``SPLIT_ALIGNMENT`` elements from its start, so every element takes the path it takes
when the whole segment is one tensor (the update pass's docstring says why that keeps it bitwise)."""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import numpy as np

from optimizer_node.update.kernels import compiled_update
from protos.job.placement import SPLIT_ALIGNMENT

CHUNK_NUMEL = 512 << 10
"""Elements per chunk of the torch-ops path: 2 MiB of fp32 sum, kept in L2/L3 until the kernel reads
it; smaller chunks pay more in per-op overhead and thread start-ups than they gain (measured)."""


class Chunk(NamedTuple):
    """A range of the bucket updated by one kernel call, and the segment pieces it holds."""

    start: int
    stop: int
    pieces: tuple[tuple[int, int], ...]  # (bucket offset, numel), each within one segment


@functools.lru_cache(maxsize=4096)
def plan_chunks(segments: tuple[tuple[int, int], ...], chunk_numel: int = CHUNK_NUMEL) -> tuple[Chunk, ...]:
    """Cut a bucket's segments (which must tile it from 0, in order) into chunks of at most
    ``chunk_numel`` elements; a segment is cut only at multiples of ``SPLIT_ALIGNMENT`` from its start."""
    if chunk_numel < SPLIT_ALIGNMENT:
        raise ValueError(f"chunk_numel must be at least {SPLIT_ALIGNMENT}, got {chunk_numel}")
    chunks: list[Chunk] = []
    pieces: list[tuple[int, int]] = []
    start = size = expected = 0
    for offset, numel in segments:
        if offset != expected:
            raise ValueError(f"segments must tile the bucket in order: one starts at {offset}, expected {expected}")
        expected += numel
        done = 0
        while done < numel:
            room = chunk_numel - size
            take = numel - done if numel - done <= room else room - room % SPLIT_ALIGNMENT
            if take == 0:
                chunks.append(Chunk(start, start + size, tuple(pieces)))
                pieces, start, size = [], start + size, 0
                continue
            pieces.append((offset + done, take))
            done += take
            size += take
    if pieces:
        chunks.append(Chunk(start, start + size, tuple(pieces)))
    return tuple(chunks)


class LoopPlan(NamedTuple):
    """A bucket as the compiled loop takes it: blocks inside segments, and the segments' tails for torch."""

    blocks: np.ndarray  # (n, 2) int64 (start, stop)
    tails: tuple[tuple[int, int], ...]  # (bucket offset, numel): each segment's last numel % SPLIT_ALIGNMENT


@functools.lru_cache(maxsize=4096)
def plan_loop(segments: tuple[tuple[int, int], ...], block: int = compiled_update.BLOCK, threads: int = 1) -> LoopPlan:
    """Split each segment into its whole multiples of ``SPLIT_ALIGNMENT`` (cut in blocks of at most
    ``block`` elements) and its tail. With ``threads`` > 1 the blocks are about ``block`` elements,
    as many as a whole number of rounds over the threads: numba hands each thread an equal count of
    blocks, so 64 blocks on 14 threads would keep 6 threads idle through the last round."""
    bulks = [(offset, numel - numel % SPLIT_ALIGNMENT) for offset, numel in segments]
    total = sum(bulk for _offset, bulk in bulks)
    balanced = threads > 1 and total > block
    target = total / (threads * max(1, round(total / (threads * block)))) if balanced else block
    blocks: list[tuple[int, int]] = []
    for offset, bulk in bulks:
        units = bulk // SPLIT_ALIGNMENT
        if not units:
            continue
        count = max(1, round(bulk / target), math.ceil(bulk / (2 * block))) if balanced else math.ceil(bulk / block)
        edges = [offset + units * k // count * SPLIT_ALIGNMENT for k in range(count + 1)]  # equal to within one alignment
        blocks += [(start, stop) for start, stop in itertools.pairwise(edges) if stop > start]
    tails = tuple((offset + bulk, numel - bulk) for (offset, bulk), (_, numel) in zip(bulks, segments, strict=True) if bulk < numel)
    return LoopPlan(np.array(blocks, dtype=np.int64).reshape(-1, 2), tails)
