"""Train a tiny GPT with PyTorch Lightning, the optimizer on netoptim nodes.

The only change to a Lightning script is the strategy::

    trainer = L.Trainer(devices=2, strategy="ddp")                                  # before: DDP + the module's AdamW
    trainer = L.Trainer(devices=2, strategy=NetoptimStrategy(nodes=args.nodes))     # after (netoptim.integrations.lightning)

The ``LightningModule`` is unchanged: its ``configure_optimizers`` returns ``torch.optim.AdamW`` and a
scheduler; ``NetoptimStrategy`` runs that AdamW on the nodes as a ``RemoteAdamW`` over the same param
groups and hyperparameters, keeps the module out of ``DistributedDataParallel`` (the nodes average
the gradients), turns ``gradient_clip_val`` into the nodes' global-norm clipping, and puts the
optimizer state into Lightning's checkpoints. The model is the project's GPT
(``gpu_worker.models``), the data synthetic (token sequences that count up by a random stride), so
nothing is downloaded. Install Lightning with ``pip install 'netoptim-train[integrations]'``.

One host, two workers, one optimizer node::

    netoptim node --listen tcp://127.0.0.1:5555 &
    torchrun --standalone --nproc-per-node 2 examples/train_lightning.py --nodes tcp://127.0.0.1:5555

``--devices`` defaults to the workers torchrun starts on this host. A checkpoint is written to
``--output-dir`` at the end of every epoch; ``--resume`` continues from ``last.ckpt`` there (the
checkpoint's parameters and moments replace what the nodes hold). Without ``--nodes`` the nodes come
from ``$NETOPTIM_NODES`` or the host file ``$NETOPTIM_NODE_FILE``, read on rank 0 (docs/launch.md).
See docs/integrations.md.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import lightning.pytorch as pl
import torch

from gpu_worker.discovery import nodes_option
from gpu_worker.models import GPT, GPTConfig
from netoptim.integrations.lightning import NetoptimStrategy


def counting_tokens(count: int, length: int, vocab: int, seed: int) -> torch.utils.data.TensorDataset:
    """``count`` sequences of ``length + 1`` tokens: a random start and stride, counting up modulo the vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (count, 1), generator=generator)
    stride = torch.randint(1, 8, (count, 1), generator=generator)
    tokens = (start + stride * torch.arange(length + 1)) % vocab
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


class TinyGPT(pl.LightningModule):
    """A GPT with AdamW (no decay on biases, norms and embeddings) and warmup + cosine decay."""

    def __init__(self, config: GPTConfig, lr: float, steps: int) -> None:
        super().__init__()
        self.model = GPT(config)
        self.lr, self.steps = lr, steps

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        _, loss = self.model(*batch)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> dict:
        decay = [p for name, p in self.named_parameters() if p.dim() >= 2 and "wte" not in name and "wpe" not in name]
        rest = [p for name, p in self.named_parameters() if not (p.dim() >= 2 and "wte" not in name and "wpe" not in name)]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=self.lr, betas=(0.9, 0.95))
        warmup = max(1, self.steps // 20)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, self.steps - warmup))))

        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, factor), "interval": "step"}}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Train a tiny GPT with Lightning and the optimizer on netoptim nodes.")
    parser.add_argument(
        "--nodes", default=None, help="optimizer nodes: addresses separated by commas, or a host file; default: $NETOPTIM_NODES or $NETOPTIM_NODE_FILE"
    )
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per worker and step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--gradient-clip-val", type=float, default=1.0, help="global-norm clipping on the nodes (0: none)")
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), help="workers on this host (default: torchrun's)")
    parser.add_argument("--output-dir", default="lightning-out", help="checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue from last.ckpt in --output-dir")
    parser.add_argument("--seed", type=int, default=0, help="model init and data")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    pl.seed_everything(args.seed, verbose=False)
    config = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=64)
    data = counting_tokens(count=4096, length=config.block_size, vocab=config.vocab_size, seed=args.seed)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True)
    trainer = pl.Trainer(
        accelerator="auto",
        devices=args.devices,
        strategy=NetoptimStrategy(nodes=nodes_option(args.nodes)),
        max_steps=args.steps,
        gradient_clip_val=args.gradient_clip_val or None,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=args.output_dir, save_last=True)],
        logger=False,
        log_every_n_steps=max(1, args.steps // 10),
    )
    checkpoint = Path(args.output_dir) / "last.ckpt"
    trainer.fit(TinyGPT(config, args.lr, args.steps), loader, ckpt_path=checkpoint if args.resume and checkpoint.exists() else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
