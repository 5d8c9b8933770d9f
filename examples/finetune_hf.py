"""Fine-tune your own Hugging Face causal LM layer-wise, the optimizer on netoptim nodes: the model is
never whole on a worker, and its pretrained weights go from the directory's shards to the nodes a
tensor at a time (docs/finetune.md).

One host, two workers, one optimizer node that checkpoints::

    netoptim node --listen tcp://127.0.0.1:5555 --checkpoint-dir ckpt/node0 --checkpoint-every 50 --resume &
    torchrun --standalone --nproc-per-node 2 examples/finetune_hf.py --model path/to/model --nodes tcp://127.0.0.1:5555

Several hosts (two worker hosts with 4 workers each, optimizer nodes on two CPU hosts, CURVE keys as
in examples/train_gpt.py)::

    # on each CPU host (10.0.0.11 and 10.0.0.12)
    netoptim node --listen tcp://0.0.0.0:5555 --curve-secret-key keys/node.key_secret --curve-allow allowed \\
        --checkpoint-dir /data/ckpt --checkpoint-every 200 --resume
    # on every worker host; the first (10.0.0.1) hosts the rendezvous
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 --rdzv-id ft1 \\
        examples/finetune_hf.py --model /shared/model --nodes tcp://10.0.0.11:5555,tcp://10.0.0.12:5555 \\
        --curve-secret-key 'keys/worker{rank}.key_secret' --curve-server-key keys/node.key

Then back to Hugging Face: ``netoptim export --hf finetuned/ --hf-config path/to/model CKPT_DIRS...``.

The text is a file of your own (``--text``) or, by default, the Python standard library's sources,
tokenized with the model's tokenizer where its directory has one (else as bytes). A step's batch is a
function of the step and the rank only, so a worker restarted with the same command continues with
exactly the data it would have seen, at the step the nodes say (``optimizer.remote_step``).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch

from gpu_worker.discovery import nodes_option
from netoptim.integrations.hf_layerwise import offload_causal_lm
from netoptim.recipes.stdlib_text import batch_for_step, load_stdlib_bytes


def tokens_of(model_dir: Path, text_file: str | None, vocab_size: int) -> torch.Tensor:
    """The training text as token ids: the model's tokenizer where its directory has one, else bytes."""
    raw = Path(text_file).read_bytes() if text_file else bytes(load_stdlib_bytes().tolist())
    if (model_dir / "tokenizer_config.json").is_file() or (model_dir / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(str(model_dir))(raw.decode("utf-8", errors="replace"))["input_ids"]
        return torch.tensor(ids, dtype=torch.long)
    if vocab_size < 256:
        raise ValueError(f"{model_dir} has no tokenizer and a vocabulary of {vocab_size} < 256: bytes do not fit it")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face model directory (config.json and safetensors shards)")
    parser.add_argument("--nodes", type=nodes_option, default=None, help="node addresses (comma-separated) or a host file; default: $NETOPTIM_NODES")
    parser.add_argument("--text", default=None, help="a text file to train on (default: the Python standard library's sources)")
    parser.add_argument("--steps", type=int, default=100, help="training steps (default: %(default)s)")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step over all workers (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: %(default)s)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="global-norm clipping on the nodes; 0: none (default: %(default)s)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute each layer's activations in backward")
    parser.add_argument("--curve-secret-key", default=None, help="this worker's CURVE secret key file ('{rank}' is replaced)")
    parser.add_argument("--curve-server-key", default=None, help="the nodes' CURVE public key file")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data order (default: %(default)s)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    secret = args.curve_secret_key.replace("{rank}", str(rank)) if args.curve_secret_key else None
    model, optimizer = offload_causal_lm(
        args.model,
        nodes=args.nodes,
        rank=rank,
        world_size=world_size,
        lr=args.lr,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm or None,
        gradient_checkpointing=args.gradient_checkpointing,
        curve_secret_key=secret,
        curve_server_key=args.curve_server_key,
    )
    tokens = tokens_of(Path(args.model), args.text, model.config.vocab_size)
    loss = torch.tensor(float("nan"))
    for step in range(optimizer.remote_step, args.steps):  # a restarted worker goes on where the nodes are
        x, _ = batch_for_step(tokens, step, global_batch=args.global_batch, block_size=args.seq_len, rank=rank, world_size=world_size, seed=args.seed)
        loss = model(input_ids=x, labels=x).loss  # the model shifts the labels itself
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    optimizer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
