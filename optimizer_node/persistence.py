"""Checkpoints, resume and drain for a node. A mixin of :class:`~optimizer_node.daemon.NodeDaemon`
(daemon thread only), beside the file format in :mod:`optimizer_node.checkpoint`.

Checkpoints are taken between steps only, when every owned bucket has had the same number of
updates and no gradient of the next step has been accepted: then the state is exactly "after step
s", workers that restart resume their data at s, and nothing is lost or applied twice.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from job.spec import JobSpec
from optimizer_node.checkpoint import CheckpointError, read_latest, step_directory, write_checkpoint
from optimizer_node.config import NodeConfig
from optimizer_node.faults import CrashPoints
from optimizer_node.job_state import ActiveJob

if TYPE_CHECKING:
    from optimizer_node.job_state import BucketStep
    from optimizer_node.overrides import OperatorOverrides
    from optimizer_node.storage import BucketStore

log = logging.getLogger(__name__)


class CheckpointControls:
    """Checkpoint, resume and drain on the daemon's state."""

    config: NodeConfig
    node_id: str
    _job: ActiveJob | None
    _store: BucketStore
    _in_flight: dict[int, BucketStep]
    _overrides: OperatorOverrides
    _crash_points: CrashPoints
    _checkpoint_waiters: list[Future]
    _drain_step: int | None  # set while draining: no gradients for this step or later
    _last_checkpoint: dict[str, Any] | None

    if TYPE_CHECKING:  # provided by NodeDaemon

        @property
        def step(self) -> int: ...

    def _between_steps(self) -> bool:
        steps = {state.step for state in self._store}
        return self._job is not None and len(steps) <= 1 and not self._in_flight and len(self._store) == len(self._job.owned)

    def checkpoint(self, origin: str = "automatic") -> dict[str, Any]:
        """Write a checkpoint now; ``ValueError`` when the node has no checkpoint_dir, no job, or is
        in the middle of a step; :class:`CheckpointError` when the write fails (state untouched).
        ``origin``: ``manual`` for one an operator asked for, which ``--keep`` never prunes."""
        if not self.config.checkpoint_dir:
            raise ValueError("this node has no checkpoint directory: start it with --checkpoint-dir")
        if self._job is None:
            raise ValueError("no job is registered yet: nothing to checkpoint")
        if not self._between_steps():
            raise ValueError(f"step {self.step + 1} is in flight: checkpoints are taken between steps")
        meta = {
            "node_id": self.node_id,
            "node_index": self._job.node_index,
            "job": self._job.spec.to_wire(),
            **self._overrides.to_manifest(),
            "origin": origin,
        }
        manifest = write_checkpoint(
            Path(self.config.checkpoint_dir),
            step=self.step,
            states=list(self._store),
            meta=meta,
            keep=self.config.keep,
            write_file=self._store.write_checkpoint_file,
            after_file=lambda: self._crash_points.passed("checkpoint"),
        )
        manifest["path"] = str(step_directory(Path(self.config.checkpoint_dir), self.step))
        self._last_checkpoint = manifest
        log.info("checkpoint of step %d written to %s (%d buckets)", self.step, manifest["path"], len(manifest["files"]))
        return manifest

    def request_checkpoint(self) -> Future:
        """A checkpoint now if between steps, else at the end of the step in flight."""
        future: Future = Future()
        if not self.config.checkpoint_dir or self._job is None:
            future.set_exception(
                ValueError(
                    "this node has no checkpoint directory: start it with --checkpoint-dir"
                    if not self.config.checkpoint_dir
                    else "no job is registered yet: nothing to checkpoint"
                )
            )
            return future
        self._checkpoint_waiters.append(future)
        if self._between_steps():
            self._settle_waiters()
        return future

    def drain(self) -> Future:
        """Finish the step in flight, checkpoint, and accept no gradient of a later step."""
        if self._drain_step is None:
            self._drain_step = self.step + (0 if self._between_steps() else 1)
            log.warning("draining: gradients up to step %d are accepted, none after", self._drain_step)
        return self.request_checkpoint()

    def _settle_waiters(self) -> None:
        waiters, self._checkpoint_waiters = self._checkpoint_waiters, []
        if not waiters:
            return
        try:
            manifest = self.checkpoint(origin="manual")  # asked for by an operator (checkpoint, drain)
        except (CheckpointError, ValueError) as exc:
            log.error("checkpoint failed: %s", exc)
            for waiter in waiters:
                waiter.set_exception(exc)
            return
        for waiter in waiters:
            waiter.set_result(manifest)

    def _checkpoint_due(self, step: int) -> bool:
        """Whether reaching ``step`` writes a periodic checkpoint."""
        every = self.config.checkpoint_every
        return bool(every) and step % every == 0

    def _job_initialized(self) -> None:
        """Every owned bucket has its initial values: with periodic checkpoints, step 0 is written
        now, before rank 0 hears that the last bucket is in, so a node killed in step 0 can resume."""
        if self._checkpoint_due(0):
            try:
                self.checkpoint()
            except CheckpointError as exc:
                log.error("the checkpoint of the initial values failed, training goes on: %s", exc)

    def _step_completed(self, step: int) -> None:
        """Called by the daemon when every owned bucket reached ``step``."""
        self._overrides.step_begins()
        if self._checkpoint_due(step) and not self._checkpoint_waiters:
            try:
                self.checkpoint()
            except CheckpointError as exc:  # a full disk must not stop training: say so and go on
                log.error("periodic checkpoint failed, training goes on: %s", exc)
        self._settle_waiters()

    def _checkpoint_on_exit(self) -> None:
        if not self.config.checkpoint_dir or self._job is None:
            return
        if not self._between_steps():
            log.warning("stopping in the middle of step %d: not checkpointed; the newest checkpoint is what a restart resumes from", self.step + 1)
            return
        if self._last_checkpoint is not None and self._last_checkpoint["step"] == self.step:
            return
        try:
            self.checkpoint()
        except CheckpointError as exc:
            log.error("final checkpoint failed: %s", exc)

    def _restore(self) -> None:
        """Load the newest intact checkpoint, if any (``--resume``)."""
        assert self.config.checkpoint_dir
        checkpoint = read_latest(Path(self.config.checkpoint_dir))
        if checkpoint is None:
            log.warning("--resume: no intact checkpoint under %s; starting fresh", self.config.checkpoint_dir)
            return
        manifest = checkpoint.manifest
        spec = JobSpec.from_wire(manifest["job"])
        node_index = int(manifest["node_index"])
        job = ActiveJob.create(spec, node_index)
        owned = job.owned
        if set(owned) != set(checkpoint.buckets):
            raise CheckpointError(f"{checkpoint.path} holds buckets {sorted(checkpoint.buckets)}, the job's plan gives node {node_index} {sorted(owned)}")
        self._job = job
        for bucket_id, snapshot in sorted(checkpoint.buckets.items()):
            state = self._store.restore(bucket_id, snapshot.step, snapshot.step_tensor, snapshot.path, snapshot.numel)
            if snapshot.segment_steps is not None:
                if len(snapshot.segment_steps) != len(job.segments[bucket_id]):
                    raise CheckpointError(
                        f"{checkpoint.path}: bucket {bucket_id} has {len(job.segments[bucket_id])} segments, its step counts {len(snapshot.segment_steps)}"
                    )
                state.set_segment_step_counts(snapshot.segment_steps)
        named = self._overrides.restore(manifest, checkpoint.path.name)
        if named:
            log.warning("overrides restored from the checkpoint and in force: %s (netoptim admin set-hparams --clear drops them)", ", ".join(named))
        self._last_checkpoint = manifest
        log.info("resumed from %s: step %d, %d buckets, %d workers", checkpoint.path, checkpoint.step, len(owned), spec.world_size)
