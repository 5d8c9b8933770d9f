"""The moment formats a job may ask of its nodes: plain constants, readable without torch (the command
line offers them as choices)."""

from __future__ import annotations

MOMENT_FORMATS = ("fp32", "bf16", "8bit")
"""How the nodes store the optimizer's moments (:attr:`protos.job.spec.JobSpec.moments`): ``fp32`` as
torch does; ``bf16``; ``8bit``, blockwise with an absmax scale per block and the dynamic map (see
:mod:`optimizer_node.moments`). The fp32 master parameters are exact in every format."""

MOMENT_BLOCKS = (64, 128, 256, 512, 1024, 2048, 4096)
"""Block sizes (elements per scale) an 8-bit job may choose (:attr:`protos.job.spec.JobSpec.moment_block`)."""

DEFAULT_MOMENT_BLOCK = 256
