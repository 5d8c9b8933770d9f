"""Data-parallel training of a small Llama-architecture ``transformers`` model with the optimizer on
netoptim nodes: the GPT recipe's data, schedule and loop (:mod:`netoptim.recipes.train_gpt`) with a
``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` (byte-level: 256 tokens), initialized
from ``--seed``. It needs ``transformers`` (``pip install 'netoptim-train[integrations]'``).

One worker per process; ``RANK`` and ``WORLD_SIZE`` come from ``torchrun`` (or ``run_workers``)::

    netoptim node --listen tcp://127.0.0.1:5555 &
    torchrun --standalone --nproc-per-node 2 -m netoptim.recipes.train_hf_llama --nodes tcp://127.0.0.1:5555
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from gpu_worker import RemoteAdamW
from netoptim.integrations._extras import require
from netoptim.recipes.train_gpt import (
    add_model_flags,
    add_security_flags,
    add_training_flags,
    optimizer_options,
    param_groups,
    parse_recipe_args,
    start_worker,
    train,
)

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM

VOCAB_SIZE = 256  # byte-level, as the GPT recipe: the standard library's bytes are the tokens


def build_parser() -> argparse.ArgumentParser:
    """The recipe's flags: the GPT recipe's training, shape and security flags, and the Llama-only ones."""
    parser = argparse.ArgumentParser(description="Train a small byte-level Llama (transformers) on the Python standard library with netoptim.")
    add_training_flags(parser)
    add_model_flags(parser, block_size=128)
    add_llama_flags(parser)
    add_security_flags(parser)
    return parser


def add_llama_flags(parser: argparse.ArgumentParser) -> None:
    """What a Llama has beyond the GPT's shape flags: grouped-query attention and the MLP's width."""
    parser.add_argument(
        "--n-kv-head",
        type=int,
        default=2,
        help="key/value heads (grouped-query attention; --n-head must be a multiple) (default: %(default)s)",
    )
    parser.add_argument(
        "--intermediate-size",
        type=int,
        default=0,
        help="width of the gated MLP (default: 0, 4 x --n-embd; a multiple of 256 keeps its matrices whole blocks of 8-bit moments)",
    )


def check_shape(n_embd: int, n_head: int, n_kv_head: int, intermediate_size: int = 0) -> None:
    """``ValueError`` for a shape a ``LlamaConfig`` cannot take (checked before any process starts)."""
    if min(n_embd, n_head, n_kv_head) < 1 or intermediate_size < 0:
        raise ValueError(f"the Llama's sizes must be positive (intermediate size: 0 or more), got {n_embd=}, {n_head=}, {n_kv_head=}, {intermediate_size=}")
    if n_embd % n_head:
        raise ValueError(f"--n-embd {n_embd} is not a multiple of --n-head {n_head}")
    if (n_embd // n_head) % 2:
        raise ValueError(f"--n-embd / --n-head = {n_embd // n_head} is odd: rotary embeddings rotate pairs of a head's channels")
    if n_head % n_kv_head:
        raise ValueError(f"--n-head {n_head} is not a multiple of --n-kv-head {n_kv_head}")


def llama_config(args: argparse.Namespace) -> LlamaConfig:
    """The ``transformers.LlamaConfig`` of the flags; ``ImportError`` with the install command without
    transformers, ``ValueError`` for a shape it cannot take."""
    check_shape(args.n_embd, args.n_head, args.n_kv_head, args.intermediate_size)
    transformers = require("transformers", by=__name__)
    return transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=args.n_embd,
        intermediate_size=args.intermediate_size or 4 * args.n_embd,
        num_hidden_layers=args.n_layer,
        num_attention_heads=args.n_head,
        num_key_value_heads=args.n_kv_head,
        max_position_embeddings=args.block_size,
        # separate input and output embeddings: a tied matrix would be one parameter under two names
        tie_word_embeddings=False,
    )


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` of the flags' shape, initialized from ``--seed`` (the same on every rank)."""
    config = llama_config(args)
    transformers = require("transformers", by=__name__)
    torch.manual_seed(args.seed)  # every rank builds the same model; rank 0's values are registered
    return transformers.LlamaForCausalLM(config)


def main(argv: Sequence[str] | None = None) -> int:
    """Train as the module's docstring says; 0 when every step is done."""
    args = parse_recipe_args(build_parser(), argv)
    rank, world_size, global_batch = start_worker(args)
    try:
        model = build_model(args)
    except (ImportError, ValueError) as exc:
        raise SystemExit(str(exc)) from exc
    optimizer = RemoteAdamW(param_groups(model), **optimizer_options(args, rank, world_size))

    def step_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # cross-entropy on every position against the next bytes, as the GPT's loss (labels=x would
        # have the model shift them itself and drop the last position)
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    train(step_loss, optimizer, args, rank=rank, world_size=world_size, global_batch=global_batch)
    optimizer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
