"""A worker of the multi-host launch test, started by ``torchrun``: trains a small MLP for a few steps
with ``RemoteAdamW(nodes=...)`` and writes the node list it used and the parameters it ended with to
``--report`` (``rankR.json``, ``rankR.pt``). The test runs :func:`train` in threads for its reference."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gpu_worker import RemoteAdamW
from gpu_worker.discovery import NodeSource, nodes_option

STEPS = 3


def build_model() -> nn.Module:
    """The same model on every rank (rank 0's initial values are the ones registered)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def train(model: nn.Module, nodes: NodeSource, rank: int, world_size: int) -> list[str]:
    """Train ``model`` for :data:`STEPS` steps, each rank on batches of its own; the nodes it used."""
    optimizer = RemoteAdamW(model.named_parameters(), lr=1e-2, nodes=nodes, rank=rank, world_size=world_size, bucket_numel=1024, timeout_s=60)
    for step in range(STEPS):
        data = torch.Generator().manual_seed(1000 * step + rank)  # the same batches in every run
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert optimizer.remote_step == STEPS
    used = list(optimizer._session.nodes)
    optimizer.close()
    return used


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", default=None, help="as examples/train_gpt.py's --nodes; default: the environment, through rank 0")
    parser.add_argument("--report", required=True, help="directory for rankR.json and rankR.pt")
    parser.add_argument("--process-group", action="store_true", help="initialize torch.distributed (gloo) first: the list goes through its store")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"rank {os.environ.get('RANK', '?')}: %(name)s: %(message)s")
    torch.set_num_threads(1)
    if args.process_group:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = build_model()
    used = train(model, nodes_option(args.nodes), rank, world_size)
    report = Path(args.report)
    report.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), report / f"rank{rank}.pt")
    (report / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world_size": world_size, "nodes": used}))
    if args.process_group:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
