"""The modes of ``netoptim bench gpu``, in the order they run: here, without torch, so that the
command line (``netoptim --help``) names them without importing it."""

from __future__ import annotations

NETOPTIM_MODES = ("full", "layerwise")
DEEPSPEED_MODES = ("zero2", "zero3")
# compute: forward and backward alone (the GPU's share of any step); torch: the model and
# torch.optim.AdamW(fused=True) all on the GPU (the ceiling where it fits).
MODES = ("compute", "torch", "zero2", "full", "zero3", "layerwise")
