"""Worker side of netoptim: forward/backward on the worker, optimizer state on the optimizer nodes."""

from gpu_worker.layerwise.streaming import StreamStats
from gpu_worker.offload import offload
from gpu_worker.remote_adamw import RemoteAdamW
from gpu_worker.remote_optimizer import RemoteOptimizer
from gpu_worker.remote_rules import RemoteAdam, RemoteLion, RemoteSGD
from gpu_worker.session import NodeError, NonFiniteGradientError, OffloadSession

__all__ = [
    "NodeError",
    "NonFiniteGradientError",
    "OffloadSession",
    "RemoteAdam",
    "RemoteAdamW",
    "RemoteLion",
    "RemoteOptimizer",
    "RemoteSGD",
    "StreamStats",
    "offload",
]
