"""A model as an ordered list of blocks, the unit a pipeline cuts between.

Each block's ``forward`` takes one tensor (the previous block's output, or the model's input for the
first) and returns one tensor: that tensor is what crosses a stage boundary. Three kinds of models
are understood: an ``nn.Sequential``, :class:`~gpu_worker.models.gpt.GPT`, and any module with a
``pipeline_blocks()`` method returning ``(name_prefix, module)`` pairs in order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gpu_worker.models.gpt import GPT


@dataclass(frozen=True)
class PipelineBlock:
    """One block: ``prefix`` + the module's own parameter names give the names in the whole model."""

    prefix: str
    module: nn.Module

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for name, param in self.module.named_parameters():
            yield self.prefix + name, param


class GPTEmbedding(nn.Module):
    """Token + position embeddings of a :class:`GPT` (its first block)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(positions)


class GPTHead(nn.Module):
    """Final norm and output projection of a :class:`GPT` (its last block)."""

    def __init__(self, ln_f: nn.LayerNorm, head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.head = ln_f, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def pipeline_blocks(model: nn.Module) -> list[PipelineBlock]:
    """The blocks of ``model`` in forward order; ``TypeError`` when it cannot be cut into blocks."""
    if isinstance(model, GPT):
        blocks = [PipelineBlock("", GPTEmbedding(model.wte, model.wpe))]
        blocks += [PipelineBlock(f"blocks.{i}.", block) for i, block in enumerate(model.blocks)]
        return [*blocks, PipelineBlock("", GPTHead(model.ln_f, model.head))]
    method = getattr(model, "pipeline_blocks", None)
    if callable(method):
        blocks = [PipelineBlock(str(prefix), module) for prefix, module in method()]
    elif isinstance(model, nn.Sequential):
        # every entry, repeats included (named_children() would skip a module listed twice)
        blocks = [PipelineBlock(f"{name}.", module) for name, module in model._modules.items() if module is not None]
    else:
        raise TypeError(
            f"cannot split a {type(model).__name__} into pipeline stages: give an nn.Sequential, a GPT, or a module with a "
            "pipeline_blocks() method that returns (name_prefix, module) pairs in forward order, each taking the previous one's output"
        )
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no blocks to split")
    _check_no_sharing(blocks)
    return blocks


def _check_no_sharing(blocks: Sequence[PipelineBlock]) -> None:
    """Stages own disjoint parameters: a parameter used by two blocks (tied weights) could land in two
    stages whose gradients would never meet, so it is refused with the names involved."""
    owner: dict[int, str] = {}
    for index, block in enumerate(blocks):
        for name, param in block.module.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(param), f"block {index} ({block.prefix}{name})")
            if not first.startswith(f"block {index} "):
                raise ValueError(
                    f"parameter {block.prefix}{name} of block {index} is also {first}: tied weights across blocks cannot be split "
                    "into stages; untie them or merge the blocks that share them into one"
                )


class StageModule(nn.Module):
    """Consecutive blocks run one after the other: the module one pipeline stage computes."""

    def __init__(self, blocks: Sequence[PipelineBlock]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block.module for block in blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def split_points(num_blocks: int, cuts: Sequence[int], num_stages: int) -> list[tuple[int, int]]:
    """``[start, end)`` block ranges of each stage from ``cuts`` (the first block of stages 1..P-1)."""
    cuts = list(cuts)
    if len(cuts) != num_stages - 1:
        raise ValueError(f"{num_stages} stages need {num_stages - 1} cut points, got {len(cuts)}: {cuts}")
    bounds = [0, *cuts, num_blocks]
    if any(not isinstance(c, int) for c in cuts) or any(a >= b for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"cut points must be increasing block indices in [1, {num_blocks - 1}] (the model has {num_blocks} blocks), got {cuts}")
    return list(itertools.pairwise(bounds))
