"""Fine-tune a Llama-architecture model of 7B parameters on one small machine: a Hugging Face model
directory (config and bf16 safetensors shards) trained layer-wise from its shards
(:func:`~netoptim.integrations.hf_layerwise.offload_causal_lm`) against one out-of-core node that
keeps the moments in 8 bits. One process with ``torch.optim.AdamW`` would need 16 bytes per
parameter (108 GB) for parameters, gradients and moments; here the node keeps about 6 bytes per
parameter on disk under a memory budget, and the worker holds a few decoder layers at a time.

    python -m netoptim.benchmarks.showcase_llama --model-dir DIR --state-dir DIR2 --moments 8bit

Without a model at ``--model-dir`` it writes one there first: the config (Llama-2-7B's shape by
default, smaller with ``--layers``/``--hidden``/``--intermediate``) and random weights as bf16
shards, made a tensor at a time (no process ever holds the whole model). Prints JSON: the
parameters, seconds and loss per step, peak RSS of node and worker, and the node's disk bytes read
and written per step (from the kernel's accounting of the node process).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import resource
import time
from pathlib import Path

import torch

from netoptim.benchmarks.showcase_3b import run_beside_a_node, timed_steps

log = logging.getLogger(__name__)

SHARD_BYTES = 2 << 30


def write_random_llama(directory: Path, *, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int) -> int:
    """A model directory with a Llama config and random bf16 weights (normal, std 0.02; norms ones),
    written shard by shard: a tensor at a time in memory. Returns the parameter count."""
    from safetensors.torch import save_file

    from netoptim.integrations._extras import require
    from netoptim.integrations.hf_layerwise import INDEX_FILE, parameters_on_meta

    transformers = require("transformers", by=__name__)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    with parameters_on_meta():
        model = transformers.LlamaForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = shards = total = 0

    def flush() -> None:
        nonlocal shard, shard_bytes, shards
        if shard:
            shards += 1
            name = f"model-{shards:05d}.safetensors"
            save_file(shard, str(directory / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard, shard_bytes = {}, 0

    for name, param in model.named_parameters():
        if "norm" in name:
            value = torch.ones(param.shape, dtype=torch.bfloat16)
        else:
            value = (torch.randn(param.shape, generator=generator) * 0.02).to(torch.bfloat16)
        shard[name] = value
        shard_bytes += value.numel() * 2
        total += value.numel()
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    config.save_pretrained(str(directory))
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 2 * total}, "weight_map": weight_map}, indent=1))
    log.info("wrote %s: %s parameters in %d shards", directory, f"{total:,}", shards)
    return total


def _worker(node: str, model_dir: str, steps: int, threads: int, lr: float, moments: str, results: mp.Queue, node_pid: int) -> None:
    from netoptim.integrations.hf_layerwise import offload_causal_lm
    from netoptim.recipes.stdlib_text import batch_for_step, load_stdlib_bytes

    torch.set_num_threads(threads)
    started = time.perf_counter()
    model, opt = offload_causal_lm(model_dir, nodes=[node], lr=lr, moments=moments, gradient_checkpointing=True, timeout_s=3600)
    params = sum(p.numel() for p in model.parameters())
    text = load_stdlib_bytes()
    report: dict = {"params": params, "moments": moments, "register_s": time.perf_counter() - started, "steps": []}
    # One batch of Python source, the same at every step: the loss must fall as it is learnt.
    x, _next = batch_for_step(text, 0, global_batch=1, block_size=32, rank=0, world_size=1, seed=0)

    def step() -> None:
        opt.step()
        opt.synchronize()  # the step's update done on the node: its time is this step's

    report["steps"] = timed_steps(lambda: model(input_ids=x, labels=x).loss, step, steps, node_pid)  # the model shifts the labels
    report["worker_peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    opt.close()
    results.put(report)


def main(argv: list[str] | None = None) -> int:
    from netoptim.cli.arg_types import size as _size

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-dir", required=True, help="the Hugging Face model directory to train; written first (random bf16 weights) if it has no config.json"
    )
    parser.add_argument("--state-dir", required=True, help="where the node keeps its state (a local disk: ~42 GB for 7B with 8-bit moments)")
    parser.add_argument("--memory-budget", type=_size, default=6 << 30, help="node state in memory at most (default: 6GiB)")
    parser.add_argument(
        "--moments",
        choices=["fp32", "bf16", "8bit"],
        default="8bit",
        help="how the node stores the moments (default: %(default)s; fp32 needs ~84 GB of disk for 7B)",
    )
    parser.add_argument("--steps", type=int, default=2, help="training steps (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the worker (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=32, help="decoder layers of a model written here (default: %(default)s, Llama-2-7B's)")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size of a model written here (default: %(default)s)")
    parser.add_argument("--intermediate", type=int, default=11008, help="MLP width of a model written here (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=32, help="attention heads of a model written here (default: %(default)s)")
    parser.add_argument("--kv-heads", type=int, default=32, help="key-value heads of a model written here (default: %(default)s)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary of a model written here (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        write_random_llama(
            model_dir, layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab
        )
    report = run_beside_a_node(Path(args.state_dir), args.memory_budget, _worker, (str(model_dir), args.steps, args.threads, args.lr, args.moments))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
