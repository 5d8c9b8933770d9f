"""What one worker rank knows of its job at this moment, shared by the parts of its session.

The session's parts (the pushes, the awaited values, the dispatch of the nodes' messages, the
recovery of a node) read these at each use rather than keeping copies, because each may change
between steps: a param group adds parameters and buckets, a morph changes the rank and the width, a
registration sets the step this rank resumes at. The session owns the one instance and changes it;
the parts read it and move the buckets' steps as values come in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_worker.layout import describe_bucket
from gpu_worker.links.step_timings import WorkerStepTimings
from protos.job.placement import BucketSpec
from protos.job.spec import JobSpec


class RankState:
    """One rank's place in its job.

    ``nodes``: the nodes' addresses as given; ``job``: the job's spec; ``rank``: this worker's rank;
    ``params``: the job's parameters in layout order; ``buckets``: the job's plan; ``bucket_steps``:
    each bucket's step as this worker knows it (every bucket has had this many updates);
    ``resume_step``: the step this worker (re)does first, set at HELLO; ``timings``: the phases'
    times since they were last taken."""

    def __init__(self, nodes: Sequence[str], job: JobSpec, rank: int, params: Sequence[torch.Tensor]) -> None:
        self.nodes = list(nodes)
        self.job = job
        self.rank = rank
        self.params = list(params)
        self.buckets: list[BucketSpec] = job.plan()
        self.bucket_steps = [0] * len(self.buckets)
        self.resume_step = 0
        self.timings = WorkerStepTimings()

    @property
    def step(self) -> int:
        """The step the nodes are at for this worker: every bucket has had this many updates."""
        return min(self.bucket_steps, default=0)

    def describe_bucket(self, bucket_id: int) -> str:
        """The parameters a bucket holds, for messages (``w[0:128], b``)."""
        return describe_bucket(self.job.params, self.buckets[bucket_id])
