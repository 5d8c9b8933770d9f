"""Pipeline-parallel training whose stages keep their parameters on optimizer nodes.

``P x D`` ranks (as launched by ``torchrun``): rank ``r`` computes pipeline position
``r % P`` of replica ``r // P``. The ``P`` ranks of a replica exchange activations and their
gradients through ``torch.distributed.pipelining`` (gloo on CPU, NCCL on GPU); there is no
gradient all-reduce among replicas. Instead the ``D`` ranks at one pipeline position form one
netoptim job on their own group of optimizer nodes, which sums their gradients, applies AdamW once
and sends the new values back: stages are independent jobs, and a node group is as small as a
stage (MiCS's lesson: small communication groups scale).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from gpu_worker.pipeline.balance import balance
from gpu_worker.pipeline.blocks import PipelineBlock, StageModule, pipeline_blocks, split_points
from gpu_worker.pipeline.partition import calibrate
from gpu_worker.pipeline.repartition import gather_training_state, load_training_state
from gpu_worker.remote_adamw import RemoteAdamW

log = logging.getLogger(__name__)

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class PipelineError(RuntimeError):
    """A peer rank stopped or a link broke: this rank stops too, and says which one it is."""


_LINK_FAILURES = ("gloo", "NCCL", "Connection closed", "Connection reset", "Broken pipe", "timed out", "Timed out")
"""What torch.distributed's backends put in the (plain RuntimeError) message of a failed collective or p2p."""


def _is_link_failure(exc: RuntimeError) -> bool:
    return isinstance(exc, dist.DistError) or any(marker in str(exc) for marker in _LINK_FAILURES)


@dataclass(frozen=True)
class PipelineConfig:
    """How the model is pipelined.

    ``cuts`` gives the first block of every stage but the first; ``None`` balances the stages on a
    short calibration of each block (rank 0 measures, every rank uses its cuts).
    ``stages_per_rank`` > 1 (the interleaved schedule) gives each rank that many non-adjacent
    stages, stage ``i`` on position ``i % P``.
    """

    num_stages: int
    num_microbatches: int
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    cuts: tuple[int, ...] | None = None

    def validate(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} is not one of {list(SCHEDULES)}")
        if (self.schedule == "interleaved") != (self.stages_per_rank > 1):
            raise ValueError("the interleaved schedule needs stages_per_rank >= 2, and stages_per_rank >= 2 needs the interleaved schedule")
        if self.stages_per_rank < 1:
            raise ValueError(f"stages_per_rank must be >= 1, got {self.stages_per_rank}")
        if self.schedule == "1f1b" and self.num_microbatches < self.num_stages:
            raise ValueError(
                f"the 1f1b schedule needs at least as many micro-batches ({self.num_microbatches}) as stages ({self.num_stages}); use gpipe or more"
            )
        if self.schedule == "interleaved" and self.num_microbatches % self.num_stages:
            raise ValueError(f"the interleaved schedule needs num_microbatches ({self.num_microbatches}) to be a multiple of num_stages ({self.num_stages})")


@dataclass
class StepTimes:
    """Where a rank's last step went: compute inside its stages, the pipeline as a whole, the optimizer."""

    compute_s: float = 0.0
    pipeline_s: float = 0.0
    optimizer_s: float = 0.0

    @property
    def bubble_fraction(self) -> float:
        """Share of the pipeline time this rank's stages were not computing."""
        return 0.0 if self.pipeline_s <= 0 else max(0.0, 1.0 - self.compute_s / self.pipeline_s)


class PipelineTrainer:
    """Train ``model`` on ``P x D`` ranks with its optimizer state on optimizer nodes.

    Args:
        model: an ``nn.Sequential``, a GPT, or a module with ``pipeline_blocks()`` (see
            :func:`~gpu_worker.pipeline.blocks.pipeline_blocks`). Every rank builds it the same way;
            a rank keeps only the blocks of its own stages (the nodes' values replace the rest).
        loss_fn: ``loss_fn(output, target)`` of one micro-batch, a mean over its samples.
        config: stages, micro-batches, schedule, cut points.
        nodes: every optimizer node's data-plane address; they are dealt out in ``P`` equal groups,
            ``nodes[s*k:(s+1)*k]`` serving pipeline position ``s``.
        calibration_input: a micro-batch of model inputs for the calibration (when ``config.cuts``
            is None).
        device: where the stages compute.
        param_groups: turns this rank's ``(name, parameter)`` pairs into optimizer param groups
            (for example weight decay on matrices only); default: one group.
        optimizer_options: passed to :class:`RemoteAdamW` (``lr``, ``betas``, ``wire_dtype``,
            ``timeout_s``...). ``max_grad_norm`` needs the global norm over all stages and is
            refused for ``P > 1``.

    ``torch.distributed`` must be initialized with ``P x D`` ranks.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        config: PipelineConfig,
        *,
        nodes: Sequence[str],
        calibration_input: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        param_groups: Callable[[list[tuple[str, nn.Parameter]]], list[dict[str, Any]]] | None = None,
        **optimizer_options: Any,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("initialize torch.distributed first (torchrun + dist.init_process_group('gloo' or 'nccl'))")
        if isinstance(nodes, str):
            raise ValueError(f"the string {nodes!r} cannot be dealt out to {config.num_stages} pipeline positions: give a list of node addresses")
        self.device = torch.device(device)
        self.times = StepTimes()
        self._loss_fn, self._nodes, self._param_groups, self._optimizer_options = loss_fn, list(nodes), param_groups, optimizer_options
        self._build(model, config, calibration_input)

    def _build(self, model: nn.Module, config: PipelineConfig, calibration_input: torch.Tensor | None) -> None:
        """Deal out the stages of ``model`` by ``config`` (its cuts, or balanced on a calibration) and
        register each position's parameters with its node group, from the values ``model`` holds."""
        config.validate()
        world, rank = dist.get_world_size(), dist.get_rank()
        num_positions = config.num_stages
        if world % num_positions:
            raise ValueError(f"world size {world} is not a multiple of num_stages {num_positions}: launch num_stages x replicas ranks")
        nodes, optimizer_options, param_groups, loss_fn = self._nodes, self._optimizer_options, self._param_groups, self._loss_fn
        if len(nodes) % num_positions:
            raise ValueError(f"{len(nodes)} node addresses cannot be dealt out to {num_positions} pipeline positions: give a multiple of {num_positions}")
        if num_positions > 1 and optimizer_options.get("max_grad_norm") is not None:
            raise ValueError("max_grad_norm needs one norm over all stages, which stage-wise node groups do not compute; clip with P = 1")
        self.config = config
        self.num_replicas = world // num_positions
        self.position, self.replica = rank % num_positions, rank // num_positions
        groups = [dist.new_group(ranks=[d * num_positions + s for s in range(num_positions)]) for d in range(self.num_replicas)]
        self._pipe_group = groups[self.replica]

        blocks = pipeline_blocks(model)
        total_stages = num_positions * config.stages_per_rank
        cuts = list(config.cuts) if config.cuts is not None else self._calibrated_cuts(blocks, total_stages, calibration_input)
        self.cuts = tuple(cuts)
        self.stage_ranges = split_points(len(blocks), cuts, total_stages)
        self.stage_indices = [self.position + num_positions * v for v in range(config.stages_per_rank)]
        self.stage_modules = [StageModule(blocks[a:b]).to(self.device) for a, b in (self.stage_ranges[i] for i in self.stage_indices)]
        named = [pair for i in self.stage_indices for block in blocks[slice(*self.stage_ranges[i])] for pair in block.named_parameters()]
        self._named = named
        share = len(nodes) // num_positions
        self.optimizer = RemoteAdamW(
            named if param_groups is None else param_groups(named),
            nodes=list(nodes[self.position * share : (self.position + 1) * share]),
            rank=self.replica,
            world_size=self.num_replicas,
            **optimizer_options,
        )
        self._stages = [
            PipelineStage(module, index, total_stages, self.device, group=self._pipe_group)
            for module, index in zip(self.stage_modules, self.stage_indices, strict=True)
        ]
        for stage in self._stages:
            self._time_compute(stage)
        if config.schedule == "interleaved":
            self._schedule = ScheduleInterleaved1F1B(self._stages, config.num_microbatches, loss_fn=loss_fn)
        else:
            kind = ScheduleGPipe if config.schedule == "gpipe" else Schedule1F1B
            self._schedule = kind(self._stages[0], config.num_microbatches, loss_fn=loss_fn)
        self.is_first = 0 in self.stage_indices
        self.is_last = total_stages - 1 in self.stage_indices
        log.info(
            "rank %d: position %d of %d, replica %d of %d, stages %s (blocks %s), %s schedule, %d micro-batches",
            rank, self.position, num_positions, self.replica, self.num_replicas, self.stage_indices,
            [self.stage_ranges[i] for i in self.stage_indices], config.schedule, config.num_microbatches,
        )  # fmt: skip

    def _calibrated_cuts(self, blocks: list[PipelineBlock], total_stages: int, sample: torch.Tensor | None) -> list[int]:
        """Rank 0 measures and balances; everyone uses its answer (timings differ between ranks)."""
        answer: list[Any] = [None]
        if dist.get_rank() == 0:
            if sample is None:
                raise ValueError("give cut points (config.cuts) or a calibration_input micro-batch to measure the blocks on")
            answer[0] = balance(calibrate(blocks, sample), total_stages)
            log.info("calibrated cut points for %d stages: %s", total_stages, answer[0])
        dist.broadcast_object_list(answer, src=0)
        return list(answer[0])

    def _time_compute(self, stage: PipelineStage) -> None:
        """Accumulate the time this stage spends computing (forward and backward of one chunk)."""
        for name in ("forward_one_chunk", "backward_one_chunk"):
            original = getattr(stage, name, None)
            if original is None:  # another torch release: train on, without the compute/bubble figures
                log.warning("torch's PipelineStage has no %s: compute time and bubble are not measured", name)
                continue

            def timed(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.times.compute_s += time.perf_counter() - started

            setattr(stage, name, timed)

    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> float:
        """One training step on this replica's batch: ``inputs`` on the rank with the first stage,
        ``targets`` on the rank with the last (others may pass them too; they are ignored). Returns
        the loss averaged over micro-batches and replicas, on every rank."""
        self.times.compute_s = 0.0
        started = time.perf_counter()
        losses: list[torch.Tensor] = []
        args = (inputs.to(self.device),) if self.is_first and inputs is not None else ()
        target = targets.to(self.device) if self.is_last and targets is not None else None
        if self.is_first and not args:
            raise ValueError("the rank with the first stage needs the inputs")
        if self.is_last and target is None:
            raise ValueError("the rank with the last stage needs the targets")
        try:
            self._schedule.step(*args, target=target, losses=losses)
            # One small all-reduce over every rank: the loss for everyone, and a check that no rank
            # stopped before anyone waits on the nodes for a replica that will never push.
            total = torch.tensor([float(sum(loss.item() for loss in losses)), float(len(losses))], device=self.device)  # NCCL: on the GPU
            dist.all_reduce(total)
        except RuntimeError as exc:
            if not _is_link_failure(exc):
                raise  # an error of the model or the loss on this rank: as it is
            raise PipelineError(
                f"rank {dist.get_rank()} (position {self.position}, replica {self.replica}): a peer rank stopped or its link broke: {exc}".strip()
            ) from exc
        pipelined = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        done = time.perf_counter()
        self.times.pipeline_s, self.times.optimizer_s = pipelined - started, done - pipelined
        return float(total[0] / total[1])

    def repartition(self, model: nn.Module, config: PipelineConfig, calibration_input: torch.Tensor | None = None) -> None:
        """Morph the pipeline between steps (every rank calls it): another stage split, another number
        of stages (the replicas follow: ``world / num_stages``), with the same training state. Each
        position's parameters and optimizer state are gathered from its nodes and shared with every
        rank, the old jobs end (the nodes take the new ones: ``netoptim node --next-job take``), and
        the stages are rebuilt from ``model`` (the same architecture, built afresh: its values are
        replaced by the trained ones). ``config.cuts`` ``None``: the planner balances the new stages
        on a calibration (``calibration_input``). Training continues bit for bit as a job that had the
        new split from this step would. An LR scheduler must be made again on the new ``optimizer``."""
        state = gather_training_state(self.optimizer, self._named, self.replica)
        self.optimizer.close()  # the nodes' old jobs are finished once every position's ranks said BYE
        dist.barrier()
        load_training_state(model, state)
        self._build(model, config, calibration_input)
        self.optimizer.load_state_dict(state.optimizer_state_for(self.optimizer, self._named))
        dist.barrier()  # no rank pushes a gradient of the new split before every position's state is in
        log.info(
            "rank %d: pipeline repartitioned: %d stages, cuts %s, position %d of replica %d",
            dist.get_rank(),
            config.num_stages,
            list(self.cuts),
            self.position,
            self.replica,
        )

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under their names in the whole model."""
        return list(self._named)

    def close(self) -> None:
        self.optimizer.close()
