"""Run by ``test_lightning.py`` under ``torchrun --nproc-per-node 2``: a ``LightningModule`` that
configures ``torch.optim.AdamW`` and a per-step ``LambdaLR`` trains with ``Trainer(strategy=NetoptimStrategy(...))``
in three runs, one job after another on one optimizer node; every rank saves what it trained on, its
local gradients, the nodes' gradient norms and its final parameters.

- ``plain``: ``STEPS`` steps (two epochs of ``SAVED_AT`` steps, shuffled), no clipping;
- ``clip``: the same with ``gradient_clip_val=CLIP`` (the nodes clip);
- ``resume``: ``plain``'s configuration (in buckets of another size: a job of its own for the node),
  checkpointed with ``trainer.save_checkpoint`` after the last batch of the first epoch (Lightning
  resumes a plain ``DataLoader`` exactly only at an epoch's end), stopped one step later; then a new
  trainer and a new module resume from that checkpoint to ``STEPS``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from netoptim.integrations.lightning import NetoptimStrategy
from tests.gpu_worker.harness import make_model
from tests.integrations.common import CLIP, LR, PER_RANK, SAVED_AT, STEPS, WORLD_SIZE, decay_groups, loss_of, samples, warmup_then_linear


class RegressionModule(pl.LightningModule):
    """The worker tests' model; keeps its batches, its local gradients and the nodes' norms."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.norms: list[float | None] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.seen.append((x.clone(), y.clone()))
        return loss_of(self.net, x, y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.grads.append({name: p.grad.detach().clone() for name, p in self.named_parameters()})

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.norms.append(self.trainer.optimizers[0].last_grad_norm)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(decay_groups(self), lr=LR)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_linear)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class SaveThenStop(pl.Callback):
    """``trainer.save_checkpoint(path)`` after step ``SAVED_AT``, the last of the first epoch (as
    ``ModelCheckpoint(every_n_train_steps=...)`` saves), and a stop one step later."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == SAVED_AT:
            trainer.save_checkpoint(self.path)
        if trainer.global_step == SAVED_AT + 1:
            trainer.should_stop = True


def loader() -> torch.utils.data.DataLoader:
    """One epoch is ``SAVED_AT`` steps of ``PER_RANK`` samples per rank."""
    x, y = samples(SAVED_AT * PER_RANK * WORLD_SIZE)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=PER_RANK, shuffle=True)


def train(address: str, out: Path, *, bucket_numel: int, clip: float | None = None, save: Path | None = None, resume: Path | None = None) -> dict:
    module = RegressionModule()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=NetoptimStrategy(nodes=[address], optimizer_options={"bucket_numel": bucket_numel, "timeout_s": 60}),
        max_steps=STEPS,
        gradient_clip_val=clip,
        callbacks=[SaveThenStop(save)] if save is not None else [],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
    )
    trainer.fit(module, train_dataloaders=loader(), ckpt_path=resume)
    dist.barrier()  # every rank closed its optimizer: the node let the job finish
    return {
        "params": {name: p.detach().clone() for name, p in module.named_parameters()},
        "inputs": module.seen,
        "grads": module.grads,
        "norms": module.norms,
        "wrapped": type(trainer.strategy.model).__name__,
        "optimizer": type(trainer.optimizers[0]).__name__,
        "gradient_clip_val": trainer.gradient_clip_val,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    out, checkpoint = args.out, args.out / "saved.ckpt"
    results = {
        "plain": train(args.address, out / "plain", bucket_numel=300),
        "clip": train(args.address, out / "clip", bucket_numel=300, clip=CLIP),
        "interrupted": train(args.address, out / "resume", bucket_numel=256, save=checkpoint),
        "resumed": train(args.address, out / "resume", bucket_numel=256, resume=checkpoint),
    }
    torch.save(results, out / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
