"""``netoptim bench convergence``: does keeping the moments compressed on the nodes cost loss?

For each seed and each ``--moments`` setting, a recipe trains ``--steps`` steps with ``--workers``
worker processes against ``--nodes`` real node daemons on loopback: with ``--model gpt`` the GPT recipe
(:mod:`netoptim.recipes.train_gpt`, the same code ``netoptim demo`` and ``torchrun`` run), with
``--model llama`` a small ``transformers`` Llama on the same data, schedule and loop
(:mod:`netoptim.recipes.train_hf_llama`; it needs ``transformers``). The seed sets the model's initial
values and the data order, so the settings of one seed see the same batches and start from the same point.
The runs go seed after seed, every setting within a seed, so a slow spell of the machine falls on all
settings alike (only time would change, not the losses: the training is deterministic).

A run's loss at a step is the mean of the workers' losses (each on its equal share of the batch):
the global batch's loss. Its final loss is the mean over the last ``--window`` steps. Per setting
the report gives the final loss of every seed, their median, and ``ratio``: the median over seeds
of the setting's final loss over fp32's with the same seed (paired, so the seeds' own spread
cancels); ``within_1pct`` says whether that ratio is within 1% of 1. The top-level ``ratio`` is
fp32's final loss over the worst compressed setting's (higher is better, 1 when compression costs
nothing), for the ``ratio`` every benchmark reports. ``curves`` holds the loss curves, medians over
seeds of the mean loss of each ``curve_every`` steps, for ``--plot``; ``model`` names the model trained
(``gpt`` or ``llama``), its class, its recipe and its shape.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

RECIPES = {"gpt": "netoptim.recipes.train_gpt", "llama": "netoptim.recipes.train_hf_llama"}
"""``--model``: the recipe module each model's runs launch."""
CURVE_POINTS = 50  # points per loss curve in the report: enough to see its shape, few enough to read the JSON
WITHIN = 0.01  # within_1pct: a ratio within this of 1


def final_loss(losses: list[float], window: int) -> float:
    """The mean of the last ``window`` losses (all of them when there are fewer)."""
    if not losses:
        raise ValueError("a run trained no step")
    tail = losses[-window:]
    return sum(tail) / len(tail)


def curve(losses: list[float], every: int) -> list[float]:
    """The mean loss of each ``every`` consecutive steps (the last group may be shorter)."""
    return [sum(part) / len(part) for part in (losses[i : i + every] for i in range(0, len(losses), every))]


def recipe_flags(args: argparse.Namespace, moments: str, seed: int) -> list[str]:
    """The recipe's flags for one run (the nodes and the loss file are added by :func:`train_once`)."""
    flags = ["--steps", str(args.steps), "--seed", str(seed), "--moments", moments, "--lr", str(args.lr)]
    flags += ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head), "--block-size", str(args.block_size)]
    if model_name(args) == "gpt":
        flags += ["--sample-tokens", "0"]  # no text generated at the end: the report has no use for it
    else:
        flags += ["--n-kv-head", str(args.n_kv_head), "--intermediate-size", str(args.intermediate_size)]
    if args.global_batch:
        flags += ["--global-batch", str(args.global_batch)]
    if args.bucket_numel:
        flags += ["--bucket-numel", str(args.bucket_numel)]
    return flags


def train_once(args: argparse.Namespace, moments: str, seed: int) -> list[float]:
    """One run of the recipe against fresh local nodes; the global batch's loss at every step."""
    from netoptim.launch.niceness import SHARED_CORES_NICENESS
    from netoptim.launch.processes import NodeProcess, run_workers

    with tempfile.TemporaryDirectory(prefix="netoptim-convergence-") as workdir:
        nodes = [NodeProcess(workdir, name=f"node{i}", log_level="WARNING", nice=SHARED_CORES_NICENESS) for i in range(args.nodes)]
        try:
            for node in nodes:
                node.start()
            loss_file = str(Path(workdir) / "losses-{rank}.json")
            flags = ["--nodes", ",".join(node.address for node in nodes), "--loss-file", loss_file, *recipe_flags(args, moments, seed)]
            status = run_workers(flags, args.workers, module=RECIPES[model_name(args)], timeout_s=args.timeout_s, threads_per_worker=args.threads, quiet=True)
        finally:
            for node in nodes:
                node.stop()
        if status != 0:
            tails = "\n".join(node.log_text()[-2000:] for node in nodes)
            raise RuntimeError(f"the recipe's workers ({moments} moments, seed {seed}) exited with status {status}; the nodes' logs end:\n{tails}")
        per_rank = [json.loads(Path(loss_file.replace("{rank}", str(rank))).read_text())["losses"] for rank in range(args.workers)]
    if any(len(losses) != args.steps for losses in per_rank):
        raise RuntimeError(f"the workers trained {[len(losses) for losses in per_rank]} steps, not {args.steps}")
    return [sum(step) / len(step) for step in zip(*per_rank, strict=True)]


def model_name(args: argparse.Namespace) -> str:
    """``--model``; gpt for arguments made without it (the benchmark's first and default model)."""
    return getattr(args, "model", "gpt")


def model_report(args: argparse.Namespace) -> dict:
    """The report's ``model``: which model the runs trained, and its shape."""
    shape = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "block_size": args.block_size}
    if model_name(args) == "gpt":
        return {"name": "gpt", "class": "gpu_worker.models.GPT", "recipe": RECIPES["gpt"], **shape}
    from netoptim.recipes.train_hf_llama import VOCAB_SIZE

    llama = {"n_kv_head": args.n_kv_head, "intermediate_size": args.intermediate_size or 4 * args.n_embd, "vocab_size": VOCAB_SIZE}
    return {"name": "llama", "class": "transformers.LlamaForCausalLM", "recipe": RECIPES["llama"], **shape, **llama}


def check(args: argparse.Namespace) -> None:
    """``ValueError`` for flags that cannot make a comparison (or a model whose package is missing)."""
    if "fp32" not in args.moments:
        raise ValueError(f"--moments {','.join(args.moments)}: the ratios are over fp32 moments; include fp32")
    if model_name(args) not in RECIPES:
        raise ValueError(f"--model {model_name(args)}: not one of {', '.join(RECIPES)}")
    if args.n_embd % args.n_head:
        raise ValueError(f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head}")
    if model_name(args) == "llama":
        from netoptim.integrations._extras import require
        from netoptim.recipes.train_hf_llama import check_shape

        check_shape(args.n_embd, args.n_head, args.n_kv_head, args.intermediate_size)
        try:  # here, not in every worker of the first run
            require("transformers", by="netoptim bench convergence --model llama")
        except ImportError as exc:
            raise ValueError(str(exc)) from None
    batch = args.global_batch or 8 * args.workers
    if batch % args.workers:
        raise ValueError(f"--global-batch {batch} is not divisible by the {args.workers} workers")


def run(args: argparse.Namespace) -> dict:
    """Train every setting with every seed; the report described in the module's docstring."""
    check(args)
    seeds = list(range(args.seeds))
    settings = ["fp32", *(m for m in args.moments if m != "fp32")]  # fp32 first: the others are compared with it
    runs = [(seed, moments) for seed in seeds for moments in settings]
    losses: dict[str, dict[int, list[float]]] = {moments: {} for moments in settings}
    seconds: dict[str, dict[int, float]] = {moments: {} for moments in settings}
    for index, (seed, moments) in enumerate(runs, 1):
        log.info("convergence run %d/%d: %s, %s moments, seed %d, %d steps", index, len(runs), model_name(args), moments, seed, args.steps)
        started = time.perf_counter()
        losses[moments][seed] = train_once(args, moments, seed)
        seconds[moments][seed] = time.perf_counter() - started
        log.info("%s moments, seed %d: final loss %.4f in %.0f s", moments, seed, final_loss(losses[moments][seed], args.window), seconds[moments][seed])
    finals = {moments: [final_loss(losses[moments][seed], args.window) for seed in seeds] for moments in settings}
    every = max(1, -(-args.steps // CURVE_POINTS))
    report: dict = {
        "benchmark": "convergence",
        "steps": args.steps,
        "seeds": seeds,
        "window": min(args.window, args.steps),
        "workers": args.workers,
        "nodes": args.nodes,
        "model": model_report(args),
        "lr": args.lr,
        "global_batch": args.global_batch or 8 * args.workers,
        "settings": {},
    }
    for moments in settings:
        ratios = [final / base for final, base in zip(finals[moments], finals["fp32"], strict=True)]
        ratio = statistics.median(ratios)
        report["settings"][moments] = {
            "final_loss": [round(value, 5) for value in finals[moments]],
            "median_final_loss": round(statistics.median(finals[moments]), 5),
            "ratios": [round(value, 5) for value in ratios],
            "ratio": round(ratio, 5),
            "within_1pct": abs(ratio - 1) <= WITHIN,
            "within_1pct_per_seed": [abs(value - 1) <= WITHIN for value in ratios],
            "seconds": [round(seconds[moments][seed], 1) for seed in seeds],
        }
    compressed = [report["settings"][moments]["ratio"] for moments in settings if moments != "fp32"]
    report["ratio"] = round(1 / max(compressed), 5) if compressed else 1.0
    report["within_1pct"] = all(report["settings"][moments]["within_1pct"] for moments in settings)
    report["curve_every"] = every
    report["curves"] = {
        moments: [round(statistics.median(point), 4) for point in zip(*(curve(losses[moments][seed], every) for seed in seeds), strict=True)]
        for moments in settings
    }
    return report
