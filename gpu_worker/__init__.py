"""Worker side of netoptim: forward/backward on the worker, optimizer state on the optimizer nodes."""

from gpu_worker.remote_adamw import RemoteAdamW
from gpu_worker.session import NodeError, OffloadSession

__all__ = ["NodeError", "OffloadSession", "RemoteAdamW"]
