"""The flags that size a job for one node (``--params``, ``--workers``, ``--nodes``, ``--wire-dtype``,
``--layerwise``, ``--push-window``, ``--memory-budget``, ``--keep``, ``--moments``), shared by ``netoptim
plan-memory`` and ``netoptim doctor``, and what one node's share of that job needs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from netoptim.cli.arg_types import non_negative_int, param_count, positive_int, size

if TYPE_CHECKING:  # the command line is built without importing torch, which the node's package loads
    from optimizer_node.state.memory_plan import NodeNeeds

DEFAULTS = {
    "workers": 1,
    "nodes": 1,
    "wire_dtype": "float32",
    "push_window": 1 << 30,
    "keep": 3,
    "moments": "fp32",
}  # --keep: the node's own default (NodeConfig.keep; a test holds them equal)
"""What an optional job's flags mean when not given (``plan-memory`` requires ``--params`` and ``--workers``)."""


@dataclass(frozen=True, slots=True)
class JobSize:
    """A job as the flags describe it, and one node's share of it."""

    params: int
    workers: int
    nodes: int
    wire_dtype: str
    layerwise: bool
    push_window: int
    memory_budget: int | None
    keep: int
    moments: str = "fp32"

    @property
    def share(self) -> int:
        """Parameters one node owns (the state is spread evenly over the nodes)."""
        return -(-self.params // self.nodes)

    @property
    def wire_bytes(self) -> int:
        return 4 if self.wire_dtype == "float32" else 2

    def needs(self, *, board: bool = False) -> NodeNeeds:
        """RAM and disk one node needs for its share (:func:`optimizer_node.state.memory_plan.node_needs`)."""
        from optimizer_node.state.memory_plan import node_needs, state_bytes_per_param

        return node_needs(
            self.share,
            workers=self.workers,
            wire_bytes=self.wire_bytes,
            layerwise=self.layerwise,
            push_window_bytes=self.push_window,
            memory_budget=self.memory_budget,
            keep_checkpoints=self.keep,
            board=board,
            state_bytes=int(state_bytes_per_param(self.moments) * self.share),
        )


def add_job_size_arguments(parser: argparse.ArgumentParser, *, optional: bool) -> None:
    """The job's flags on ``parser``; ``optional``: ``--params`` may be left out (then no other of them
    may be given: :func:`job_size` refuses them), and the others have their :data:`DEFAULTS`."""
    within = "with --params: " if optional else ""

    def default(name: str) -> object:
        return None if optional else DEFAULTS[name]

    model = parser.add_mutually_exclusive_group(required=not optional)
    model.add_argument(
        "--params",
        type=param_count,
        default=None,
        help="trainable parameters of the model, like 3B, 85M or 125000000" + (": the checks then measure against one node's share" if optional else ""),
    )
    model.add_argument(
        "--hf-config",
        default=None,
        metavar="PATH",
        help="instead of --params: a Hugging Face model directory or its config.json, whose causal LM is counted "
        "(exactly, on the meta device, with transformers installed; else from the config for Llama, Mistral, Qwen2 and GPT-2)",
    )
    parser.add_argument(
        "--workers", type=positive_int, required=not optional, default=None, help=f"{within}data-parallel workers" + (" (default: 1)" if optional else "")
    )
    parser.add_argument("--nodes", type=positive_int, default=default("nodes"), help=f"{within}optimizer nodes sharing the state (default: 1)")
    parser.add_argument(
        "--wire-dtype",
        choices=["float32", "bfloat16", "float16"],
        default=default("wire_dtype"),
        help=f"{within}gradient/parameter dtype on the wire (default: float32)",
    )
    parser.add_argument("--layerwise", action="store_true", help=f"{within}workers run layer-wise mode (their push window bounds the gradients a node holds)")
    parser.add_argument(
        "--push-window", type=size, default=default("push_window"), help=f"{within}layer-wise: unconsumed gradient bytes per worker (default: 1GiB)"
    )
    parser.add_argument("--memory-budget", type=size, default=None, metavar="SIZE", help=f"{within}out of core: the node's --memory-budget, e.g. 4GiB")
    parser.add_argument(
        "--moments",
        choices=["fp32", "bf16", "8bit"],
        default=default("moments"),
        help=f"{within}how the nodes store the optimizer's moments (RemoteAdamW's moments): 12 bytes of state per parameter with fp32, "
        "8 with bf16, about 6 with 8bit (default: fp32)",
    )
    parser.add_argument(
        "--keep",
        type=non_negative_int,
        default=default("keep"),
        help=f"{within}checkpoints the node keeps on the same disk as its state (default: {DEFAULTS['keep']}, the node's --keep; 0 for a node without --checkpoint-dir there)",
    )


def job_size(args: argparse.Namespace) -> JobSize | None:
    """The job the flags describe; ``None`` without ``--params`` or ``--hf-config``. ``ValueError`` for
    another of its flags given without either (it would change nothing), and for a config that cannot
    be read or counted (:class:`~netoptim.planning.hf_config.HFConfigError`, naming the file)."""
    given = {name: getattr(args, name) for name in ("workers", "nodes", "wire_dtype", "push_window", "memory_budget", "keep", "moments")}
    params = args.params
    if getattr(args, "hf_config", None) is not None:
        from netoptim.planning.hf_config import model_size

        params = model_size(args.hf_config).params
    if params is None:
        stray = [f"--{name.replace('_', '-')}" for name, value in given.items() if value is not None] + (["--layerwise"] if args.layerwise else [])
        if stray:
            raise ValueError(f"{', '.join(stray)} size(s) a job: give --params (or --hf-config) too, or leave them out")
        return None
    filled = {name: DEFAULTS[name] if value is None and name in DEFAULTS else value for name, value in given.items()}
    return JobSize(params=params, layerwise=args.layerwise, **filled)
