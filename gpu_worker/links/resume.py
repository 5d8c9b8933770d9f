"""Where a worker goes on from, by the nodes' accounts: at registration (a restarted worker redoes the
step its predecessor left unfinished and pushes only what the nodes lack), and after a node came back
(what it lost of this worker's gradients, or why going on would mix steps).

Pure decisions over the worker's bookkeeping; :class:`gpu_worker.session.OffloadSession` (at registration)
and :class:`gpu_worker.links.recovery.NodeRecovery` (after a node came back) act on them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple


class ResumePoint(NamedTuple):
    """The step a rank (re)does first, and the buckets whose gradient of it the nodes already hold."""

    step: int
    contributed: frozenset[int]


def resume_point(accounts: Mapping[int, tuple[int, Sequence[int]]], owners: Sequence[int], rank: int) -> ResumePoint:
    """The lowest step of the nodes' accounts (node -> (the step it resumes the rank at, the buckets
    holding its gradient of that step)); ``owners[b]`` is the node of bucket ``b``. A node already a
    step further holds this rank's whole gradient of that step. ``RuntimeError`` where the nodes are
    more than a step apart (some resumed from older checkpoints)."""
    steps = {index: step for index, (step, _) in accounts.items()}
    step = min(steps.values(), default=0)
    if max(steps.values(), default=0) > step + 1:
        raise RuntimeError(f"the nodes disagree on the step of rank {rank} ({steps}): were some of them resumed from older checkpoints?")
    contributed: set[int] = set()
    for index, (node_step, buckets) in accounts.items():
        if node_step > step:
            contributed.update(b for b, owner in enumerate(owners) if owner == index)
        else:
            contributed.update(buckets)
    return ResumePoint(step, frozenset(contributed))


class WorkerProgress(NamedTuple):
    """What a worker knows of its buckets on one node, for checking the node's account after it came back."""

    rank: int
    layerwise: bool
    mine: Sequence[int]  # the node's buckets
    bucket_steps: Sequence[int]  # bucket -> the step of its installed values (layer-wise: one ahead once pushed)
    seen_step: int  # the newest step of values the node sent this process (-1: none)
    advanced_at: Mapping[int, int]  # layer-wise: bucket -> the step this process last pushed it for
    pushed: Mapping[int, int]  # bucket -> the step its gradient was pushed for, in the step in progress
    keeps_gradients: bool  # the worker holds the step's gradients and can push them again (full mode)


def gradients_lost(address: str, node_step: int, contributed: set[int], needs_init: bool, progress: WorkerProgress) -> tuple[int, list[int]]:
    """The node at ``address`` came back at ``node_step`` holding this worker's gradients of
    ``contributed``: the worker's step on that node's buckets, and the buckets whose gradient the node
    lost, which the worker pushes again. ``RuntimeError`` (saying what to restart) where going on would
    mix steps or the lost gradients are gone."""
    mine, bucket_steps = progress.mine, progress.bucket_steps
    step = min(bucket_steps[b] for b in mine) if mine else 0
    if needs_init:
        raise RuntimeError(
            f"node {address} came back without the job's state (restarted without --resume?): its buckets need initial values again; "
            "restart it with --resume from its checkpoints, then the workers"
        )
    # Layer-wise, a worker's step counts advance as it pushes: one step ahead of a node that never
    # sent it values of that step means the node lost (or still holds) what it pushed, not that it went back.
    at_step = [b for b in mine if bucket_steps[b] == step]
    pushed_ahead = (
        progress.layerwise
        and node_step == step - 1
        and progress.seen_step < step
        and all(progress.advanced_at.get(b) == node_step for b in at_step)  # this process's pushes brought them there
    )
    if node_step < step and pushed_ahead:
        lost = [b for b in at_step if b not in contributed]
        if lost:
            raise RuntimeError(
                f"node {address} restarted in the middle of step {node_step} and lost this worker's gradients of {len(lost)} bucket(s), "
                f"which layer-wise workers do not keep: restart the worker (it redoes step {node_step})"
            )
    elif node_step < step:
        raise RuntimeError(
            f"node {address} came back at step {node_step}, but rank {progress.rank} is at step {step} (the node resumed from an older checkpoint): "
            f"continuing would mix steps. To roll the job back to step {node_step}, restart every worker (they resume at the nodes' step); "
            f"otherwise restart the node from a checkpoint of step {step}"
        )
    if node_step > step + 1:
        raise RuntimeError(f"node {address} is at step {node_step}, rank {progress.rank} at step {step}: this worker is not part of that run")
    # Pushed for the node's step (not an earlier one whose values are installed), and not held there.
    lost = [b for b in mine if node_step == step and progress.pushed.get(b) == node_step and b not in contributed]
    if lost and not progress.keeps_gradients:
        keeper = "layer-wise workers do not keep" if progress.layerwise else "this worker let go once pushed (keep_step_gradients=False)"
        raise RuntimeError(
            f"node {address} restarted in the middle of step {step} and lost this worker's gradients of {len(lost)} bucket(s), which {keeper}: "
            f"restart the worker (it redoes step {step})"
        )
    return step, lost
