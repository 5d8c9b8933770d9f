"""Training text every machine has: the Python standard library's own source files, as bytes."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def load_stdlib_bytes(max_bytes: int = 4 << 20) -> torch.Tensor:
    """Up to ``max_bytes`` of the standard library's ``.py`` files, in a fixed order, as uint8 tokens."""
    root = Path(sysconfig.get_paths()["stdlib"])
    pieces: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        pieces.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(f"no Python source files found under {root}")
    return torch.frombuffer(bytearray(b"".join(pieces)[:max_bytes]), dtype=torch.uint8)


def batch_for_step(
    tokens: torch.Tensor, step: int, *, global_batch: int, block_size: int, rank: int, world_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch of ``step``: a pure function of the step, so a resumed
    run continues with exactly the data it would have seen."""
    if global_batch % world_size:
        raise ValueError(f"global batch {global_batch} is not divisible by {world_size} workers")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - block_size - 1, (global_batch,), generator=generator)
    per_rank = global_batch // world_size
    mine = starts[rank * per_rank : (rank + 1) * per_rank]
    x = torch.stack([tokens[s : s + block_size] for s in mine.tolist()]).long()
    y = torch.stack([tokens[s + 1 : s + 1 + block_size] for s in mine.tolist()]).long()
    return x, y
