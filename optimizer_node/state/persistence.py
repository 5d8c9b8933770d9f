"""Checkpoints, resume and drain for a node's job, beside the file format in
:mod:`optimizer_node.state.checkpoint`: :class:`Checkpoints` owns the checkpoints asked for and not yet
written, the drain step and the last checkpoint; one a job (node thread only), which sees where
the job stands through :class:`~optimizer_node.job_state.CurrentJob`.

Checkpoints are taken between steps only, when every owned bucket has had the same number of
updates and no gradient of the next step has been accepted: then the state is exactly "after step
s", workers that restart resume their data at s, and nothing is lost or applied twice.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optimizer_node.config import NodeConfig
from optimizer_node.faults import CrashPoints
from optimizer_node.job_state import ActiveJob, CurrentJob
from optimizer_node.moments.codec import moment_bytes
from optimizer_node.state.checkpoint import CheckpointError, read_latest, step_directory, write_checkpoint
from protos.job.spec import JobSpec

if TYPE_CHECKING:
    from optimizer_node.admin.overrides import OperatorOverrides
    from optimizer_node.state.storage import BucketStore

log = logging.getLogger(__name__)


class Checkpoints:
    """Checkpoint, resume and drain of one job: ``current`` says where the job is and holds its state
    (the store), ``overrides`` what an operator set, ``node_id`` goes into each manifest."""

    def __init__(self, config: NodeConfig, crash_points: CrashPoints, current: CurrentJob, overrides: OperatorOverrides, node_id: str) -> None:
        self.config = config
        self._crash_points = crash_points
        self._current = current
        self._store: BucketStore = current.store
        self._overrides = overrides
        self._node_id = node_id
        self.waiters: list[Future] = []  # checkpoints asked for, written at the end of the step in flight
        self.drain_step: int | None = None  # set while draining: no gradients for this step or later
        self.last: dict[str, Any] | None = None  # the manifest of the last checkpoint written or resumed from

    def make_directory(self) -> None:
        """Create the checkpoint directory now, so that a node killed before its first checkpoint can
        be restarted with ``--resume``; one that cannot be created is said, and training goes on."""
        assert self.config.checkpoint_dir is not None
        try:
            Path(self.config.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # as a failing checkpoint: said, and training goes on
            log.error("cannot create the checkpoint directory %s (%s): checkpoints will fail until it can be written", self.config.checkpoint_dir, exc)

    def checkpoint(self, origin: str = "automatic") -> dict[str, Any]:
        """Write a checkpoint now; ``ValueError`` when the node has no checkpoint_dir, no job, or is
        in the middle of a step; :class:`CheckpointError` when the write fails (state untouched).
        ``origin``: ``manual`` for one an operator asked for, which ``--keep`` never prunes."""
        if not self.config.checkpoint_dir:
            raise ValueError("this node has no checkpoint directory: start it with --checkpoint-dir")
        job = self._current.job
        if job is None:
            raise ValueError("no job is registered yet: nothing to checkpoint")
        step = self._current.step
        if not self._current.between_steps():
            raise ValueError(f"step {step + 1} is in flight: checkpoints are taken between steps")
        meta = {
            "node_id": self._node_id,
            "node_index": job.node_index,
            "job": job.spec.to_wire(),
            **self._overrides.to_manifest(),
            "origin": origin,
        }
        manifest = write_checkpoint(
            Path(self.config.checkpoint_dir),
            step=step,
            states=list(self._store),
            meta=meta,
            keep=self.config.keep,
            write_file=self._store.write_checkpoint_file,
            after_file=lambda: self._crash_points.passed("checkpoint"),
        )
        manifest["path"] = str(step_directory(Path(self.config.checkpoint_dir), step))
        self.last = manifest
        log.info("checkpoint of step %d written to %s (%d buckets)", step, manifest["path"], len(manifest["files"]))
        return manifest

    def request(self) -> Future:
        """A checkpoint now if between steps, else at the end of the step in flight."""
        future: Future = Future()
        if not self.config.checkpoint_dir or self._current.job is None:
            future.set_exception(
                ValueError(
                    "this node has no checkpoint directory: start it with --checkpoint-dir"
                    if not self.config.checkpoint_dir
                    else "no job is registered yet: nothing to checkpoint"
                )
            )
            return future
        self.waiters.append(future)
        if self._current.between_steps():
            self._settle_waiters()
        return future

    def drain(self) -> Future:
        """Finish the step in flight, checkpoint, and accept no gradient of a later step."""
        if self.drain_step is None:
            self.drain_step = self._current.step + (0 if self._current.between_steps() else 1)
            log.warning("draining: gradients up to step %d are accepted, none after", self.drain_step)
        return self.request()

    def _settle_waiters(self) -> None:
        waiters, self.waiters = self.waiters, []
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

    def due(self, step: int) -> bool:
        """Whether reaching ``step`` writes a periodic checkpoint."""
        every = self.config.checkpoint_every
        return bool(every) and step % every == 0

    def job_initialized(self) -> None:
        """Every owned bucket has its initial values: with periodic checkpoints, step 0 is written
        now, before rank 0 hears that the last bucket is in, so a node killed in step 0 can resume."""
        if self.due(0):
            try:
                self.checkpoint()
            except CheckpointError as exc:
                log.error("the checkpoint of the initial values failed, training goes on: %s", exc)

    def step_completed(self, step: int) -> None:
        """Every owned bucket reached ``step``: a periodic checkpoint if one is due, and those asked for."""
        if self.due(step) and not self.waiters:
            try:
                self.checkpoint()
            except CheckpointError as exc:  # a full disk must not stop training: say so and go on
                log.error("periodic checkpoint failed, training goes on: %s", exc)
        self._settle_waiters()

    def on_exit(self) -> None:
        """The job's last state, as a node stops or lets the job go (between steps only)."""
        if not self.config.checkpoint_dir or self._current.job is None:
            return
        if not self._current.between_steps():
            log.warning("stopping in the middle of step %d: not checkpointed; the newest checkpoint is what a restart resumes from", self._current.step + 1)
            return
        if self.last is not None and self.last["step"] == self._current.step:
            return
        try:
            self.checkpoint()
        except CheckpointError as exc:
            log.error("final checkpoint failed: %s", exc)

    def cancel_waiters(self, why: str) -> None:
        """The job is let go: the checkpoints asked for will not be written."""
        for waiter in self.waiters:
            waiter.set_exception(ValueError(f"the job was let go before its checkpoint ({why})"))
        self.waiters = []

    def restore(self) -> ActiveJob | None:
        """Load the newest intact checkpoint, if any (``--resume``), into the store and the overrides;
        returns its job, for the daemon to take up (None: nothing to resume)."""
        assert self.config.checkpoint_dir
        checkpoint = read_latest(Path(self.config.checkpoint_dir))
        if checkpoint is None:
            log.warning("--resume: no intact checkpoint under %s; starting fresh", self.config.checkpoint_dir)
            return None
        manifest = checkpoint.manifest
        spec = JobSpec.from_wire(manifest["job"])
        node_index = int(manifest["node_index"])
        job = ActiveJob.create(spec, node_index)
        owned = job.owned
        if set(owned) != set(checkpoint.buckets):
            raise CheckpointError(f"{checkpoint.path} holds buckets {sorted(checkpoint.buckets)}, the job's plan gives node {node_index} {sorted(owned)}")
        for bucket_id, snapshot in sorted(checkpoint.buckets.items()):
            codec = job.codec(bucket_id)
            if snapshot.moment_bytes != moment_bytes(codec, snapshot.numel):
                raise CheckpointError(
                    f"{checkpoint.path}: bucket {bucket_id} holds moments of {snapshot.moment_bytes} bytes, the job's {spec.moments} moments take "
                    f"{moment_bytes(codec, snapshot.numel)}: the checkpoint is damaged or from another netoptim"
                )
            state = self._store.restore(bucket_id, snapshot.step, snapshot.step_tensor, snapshot.path, snapshot.numel, codec)
            if snapshot.segment_steps is not None:
                if len(snapshot.segment_steps) != len(job.segments[bucket_id]):
                    raise CheckpointError(
                        f"{checkpoint.path}: bucket {bucket_id} has {len(job.segments[bucket_id])} segments, its step counts {len(snapshot.segment_steps)}"
                    )
                state.set_segment_step_counts(snapshot.segment_steps)
        named = self._overrides.restore(manifest, checkpoint.path.name)
        if named:
            log.warning("overrides restored from the checkpoint and in force: %s (netoptim admin set-hparams --clear drops them)", ", ".join(named))
        self.last = manifest
        log.info("resumed from %s: step %d, %d buckets, %d workers", checkpoint.path, checkpoint.step, len(owned), spec.world_size)
        return job
