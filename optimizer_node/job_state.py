"""A node's state for the job it serves and for each bucket's step in flight: what the parts of one
job (:class:`~optimizer_node.job.NodeJob`) share and read of each other, so that none of them holds
the job, or the node, that composed it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from optimizer_node.intake.step_ledger import StepLedger
from optimizer_node.moments.codec import MomentCodec, bucket_state_bytes, codec_for
from optimizer_node.update.adamw import AdamWHyper
from optimizer_node.update.reduce import OrderedReduction
from protos.job.placement import BucketSpec
from protos.job.spec import JobSpec

if TYPE_CHECKING:
    from optimizer_node.state.storage import BucketStore


@dataclass(slots=True)
class BucketStep:
    """A bucket's step in flight: gradients arriving, not yet applied."""

    step: int
    hyper: AdamWHyper
    reduction: OrderedReduction
    first_arrival: float
    clip: torch.Tensor | None = None  # the clip coefficient, once the global norm is known
    grad_norm: float | None = None
    agreed: bool = False  # the step's global round (norm, non-finite check) is done: the update is queued
    skip: bool = False  # the round found a non-finite gradient (``--non-finite skip``): the step changes nothing
    non_finite: dict[int, int] = field(default_factory=dict)  # rank -> NaN/inf values in its gradient (skip policy)
    # segments with no gradient on any rank that pushed so far (None: no push taken yet); once complete,
    # those whose parameter had no gradient on every rank: they are not stepped
    absent: frozenset[int] | None = None


@dataclass(slots=True)
class ActiveJob:
    """The job a node serves, as this node sees it: the contract and this node's share of it."""

    spec: JobSpec
    node_index: int
    owned: dict[int, BucketSpec]  # bucket_id -> spec, only this node's buckets
    segments: dict[int, list[tuple[int, int]]]  # bucket_id -> (offset, numel) per parameter piece, for the update
    divisor: torch.Tensor  # () fp32 workers in all (world size x local size): the averaging divisor, made once
    base_step: int = 0  # the step buckets created now start at: 0, or the step a param group was added at
    state_bytes: int = 0  # this node's share's state as stored (parameters and moments in the job's format)

    def codec(self, bucket_id: int) -> MomentCodec | None:
        """How the bucket's moments are stored (``None``: fp32, torch's layout)."""
        return codec_for(self.spec.moments, self.spec.moment_block, tuple(self.segments[bucket_id]))

    @classmethod
    def create(cls, spec: JobSpec, node_index: int, plan: list[BucketSpec] | None = None, base_step: int = 0) -> ActiveJob:
        """This node's share of a job; the per-bucket update arguments are derived once here, not per step."""
        owned = {b.bucket_id: b for b in (plan if plan is not None else spec.plan()) if b.node == node_index}
        segments = {b.bucket_id: [(seg.bucket_offset, seg.numel) for seg in b.segments] for b in owned.values()}
        state_bytes = sum(bucket_state_bytes(spec, bucket) for bucket in owned.values())
        return cls(spec, node_index, owned, segments, torch.tensor(float(spec.workers), dtype=torch.float32), base_step, state_bytes)


class CurrentJob:
    """Where one job stands on a node, as its parts read it: the registered job (``None`` before
    registration; replaced when the job changes its width or adds a param group), who its ranks are
    (a new ledger at each width), its bucket states and its steps in flight. State only: it calls no
    part."""

    def __init__(self, store: BucketStore) -> None:
        self.job: ActiveJob | None = None
        self.ledger = StepLedger()  # who each rank is, what it still owes, the values it may need again
        self.store = store
        self.in_flight: dict[int, BucketStep] = {}  # bucket -> its step's gradients, until its update is applied

    @property
    def step(self) -> int:
        """The step every owned bucket has reached (0 before registration)."""
        return min((state.step for state in self.store), default=0)

    def between_steps(self) -> bool:
        """Whether every owned bucket is at the same step and no gradient of the next is in."""
        job = self.job
        steps = {state.step for state in self.store}
        return job is not None and len(steps) <= 1 and not self.in_flight and len(self.store) == len(job.owned)
