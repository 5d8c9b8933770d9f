"""How fast this machine runs the node's update pass: seconds per parameter for a given number of
gradient terms (workers pushing) and update threads. The cost planner scales a node's measured cost
to machines with more cores with it (``netoptim plan --calibrate``)."""

from __future__ import annotations

import statistics
import time

import torch

from optimizer_node.intake.non_finite import count_non_finite
from optimizer_node.update.adamw import AdamWHyper
from optimizer_node.update.bucket_pass import reduce_and_update
from optimizer_node.update.kernels import compiled_update
from optimizer_node.update.reduce import OrderedReduction

BUCKET_NUMEL = 1 << 20


def update_pass_seconds_per_param(
    terms: int,
    threads: int,
    *,
    numel: int = 8 << 20,
    repeats: int = 5,
    compiled: bool = True,
    board: bool = False,
    check: bool = False,
    bucket_numel: int = BUCKET_NUMEL,
    board_copy: bool = False,
) -> float:
    """Median seconds per parameter of :func:`reduce_and_update` over ``numel`` fp32 parameters (the
    whole buckets that fit) in ``bucket_numel``-element buckets, ``terms`` gradients each, on
    ``threads`` torch threads (a warm-up first); ``compiled=False``: through torch ops, as a node runs while its compiled loop is unchecked.
    ``board``: the new values go onto a parameter board as in an fp32 job, the masters living there (each
    pass reads one slot and writes the other); ``board_copy``: as before they did, the masters updated
    in place and then copied onto the board (for comparison);
    ``check``: each gradient is checked for NaN/inf first, as a node checks every push it receives."""
    if terms < 1 or threads < 1 or bucket_numel < 1 or numel < bucket_numel or repeats < 1:
        raise ValueError(
            f"terms, threads, bucket_numel and repeats must be >= 1 and numel >= bucket_numel, got {terms}, {threads}, {bucket_numel}, {repeats}, {numel}"
        )
    buckets = numel // bucket_numel
    numel = buckets * bucket_numel
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(bucket_numel, generator=generator) for _ in range(buckets)]
    moments = [(torch.zeros(bucket_numel), torch.zeros(bucket_numel)) for _ in range(buckets)]
    steps = [torch.zeros(()) for _ in range(buckets)]
    frames = [[torch.randn(bucket_numel, generator=generator) for _ in range(terms)] for _ in range(buckets)]
    scratch = torch.empty(bucket_numel)
    hyper = AdamWHyper(1e-4, 0.9, 0.999, 1e-8, 0.01)
    divisor = torch.tensor(float(terms))
    wire_out = [torch.empty(bucket_numel) for _ in range(buckets)] if board else [None] * buckets

    def one_pass() -> float:
        started = time.perf_counter()
        for index in range(buckets):
            reduction = OrderedReduction(bucket_numel, terms, lambda: scratch, defer=True)
            for rank in range(terms):
                if check and count_non_finite([(0, frames[index][rank])]):
                    raise AssertionError("the profile's gradients are finite")
                reduction.add(rank, [(0, frames[index][rank])])
            exp_avg, exp_avg_sq = moments[index]
            beside = board and not board_copy
            reduce_and_update(
                reduction,
                params[index],
                exp_avg,
                exp_avg_sq,
                steps[index],
                hyper,
                grad_divisor=divisor,
                compiled=compiled,
                wire_out=None if beside else wire_out[index],
                param_out=wire_out[index] if beside else None,
            )
            if beside:  # the slot written holds the masters now; the next pass writes the other
                params[index], wire_out[index] = wire_out[index], params[index]
        return time.perf_counter() - started

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        compiled_update.usable()  # numba's compilation and check, before any timing
        one_pass()
        return statistics.median(one_pass() for _ in range(repeats)) / numel
    finally:
        torch.set_num_threads(previous)
