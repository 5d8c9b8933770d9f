"""The optimizer node: owns a shard of the fp32 master parameters and AdamW state and serves workers."""

from optimizer_node.config import NodeConfig
from optimizer_node.daemon import NodeDaemon

__all__ = ["NodeConfig", "NodeDaemon"]
