"""Train a tiny GPT-2 with Hugging Face's ``Trainer``, the optimizer on netoptim nodes.

The only change to a Trainer script is the trainer's class and where the nodes are::

    trainer = Trainer(model=model, args=args, train_dataset=data)                               # before: DDP + AdamW
    trainer = NetoptimTrainer(model=model, args=args, train_dataset=data, nodes=args.nodes)   # after (netoptim.integrations.huggingface)

``NetoptimTrainer`` makes a ``RemoteAdamW`` from the ``TrainingArguments`` (learning rate, betas,
epsilon, weight decay, ``max_grad_norm`` as the nodes' global-norm clipping), keeps the model out of
``DistributedDataParallel`` (the nodes average the gradients), and saves and resumes through
Trainer's own checkpoints. The model is built from a config and the data is synthetic (token
sequences that count up by a random stride, a pattern the model learns in a few hundred steps), so
nothing is downloaded. Install the frameworks with ``pip install 'netoptim-train[integrations]'``.

One host, two workers, one optimizer node::

    netoptim node --listen tcp://127.0.0.1:5555 &
    torchrun --standalone --nproc-per-node 2 examples/train_hf_trainer.py --nodes tcp://127.0.0.1:5555

Checkpoints go to ``--output-dir`` every ``--save-steps`` steps; after a stop, the same command with
``--resume`` continues from the last one (the checkpoint's parameters and moments replace what the
nodes hold). Without ``--nodes`` the nodes come from ``$NETOPTIM_NODES`` or the host file
``$NETOPTIM_NODE_FILE``, read on rank 0 (docs/launch.md). See docs/integrations.md.
"""

from __future__ import annotations

import argparse

import torch
import transformers

from gpu_worker.discovery import nodes_option
from netoptim.integrations.huggingface import NetoptimTrainer


class CountingTokens(torch.utils.data.Dataset):
    """``count`` sequences of ``length`` tokens: a random start and stride, counting up modulo the vocabulary."""

    def __init__(self, count: int, length: int, vocab: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (count, 1), generator=generator)
        stride = torch.randint(1, 8, (count, 1), generator=generator)
        self.tokens = (start + stride * torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Train a tiny GPT-2 with transformers.Trainer and the optimizer on netoptim nodes.")
    parser.add_argument(
        "--nodes", default=None, help="optimizer nodes: addresses separated by commas, or a host file; default: $NETOPTIM_NODES or $NETOPTIM_NODE_FILE"
    )
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per worker and step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (linear warmup and decay)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="global-norm clipping on the nodes (0: none)")
    parser.add_argument("--output-dir", default="hf-trainer-out", help="Trainer's checkpoints")
    parser.add_argument("--save-steps", type=int, default=100, help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    parser.add_argument("--seed", type=int, default=0, help="model init and data")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    transformers.set_seed(args.seed)
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    data = CountingTokens(count=4096, length=config.n_positions, vocab=config.vocab_size, seed=args.seed)
    training = transformers.TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        weight_decay=0.1,
        adam_beta2=0.95,
        warmup_steps=max(1, args.steps // 20),
        lr_scheduler_type="linear",
        max_grad_norm=args.max_grad_norm,
        logging_steps=max(1, args.steps // 10),
        save_strategy="steps",
        save_steps=args.save_steps,
        report_to="none",
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = NetoptimTrainer(model=model, args=training, train_dataset=data, nodes=nodes_option(args.nodes))
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
