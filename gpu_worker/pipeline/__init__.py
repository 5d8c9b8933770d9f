"""Pipeline parallelism (P stages x D replicas) with every stage's optimizer state on optimizer nodes."""

from gpu_worker.pipeline.balance import BlockCost, balance
from gpu_worker.pipeline.blocks import PipelineBlock, StageModule, pipeline_blocks, split_points
from gpu_worker.pipeline.partition import calibrate
from gpu_worker.pipeline.runtime import SCHEDULES, PipelineConfig, PipelineError, PipelineTrainer, StepTimes

__all__ = [
    "SCHEDULES",
    "BlockCost",
    "PipelineBlock",
    "PipelineConfig",
    "PipelineError",
    "PipelineTrainer",
    "StageModule",
    "StepTimes",
    "balance",
    "calibrate",
    "pipeline_blocks",
    "split_points",
]
