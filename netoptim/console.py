"""The ``netoptim`` command: ``node`` runs an optimizer-node daemon, ``demo`` trains a small GPT on this
machine, ``bench`` measures. Every flag is explained by ``netoptim SUBCOMMAND --help``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from netoptim.benchmarks.cli import add_bench_parser
from netoptim.cli.admin import add_admin_parser, run_admin
from netoptim.cli.arg_types import positive_int, size
from netoptim.cli.cluster import add_cluster_parser
from netoptim.cli.job_size_args import add_job_size_arguments, job_size
from netoptim.cli.node import run_node
from netoptim.cli.node_parser import add_node_parser
from netoptim.cli.plan import add_plan_parser, run_plan
from netoptim.doctor.command import add_doctor_parser, run_doctor

log = logging.getLogger("netoptim")


def _add_demo_parser(subparsers: argparse._SubParsersAction) -> None:
    from protos.job.moment_formats import MOMENT_FORMATS

    demo = subparsers.add_parser(
        "demo",
        help="train a small GPT on this machine: nodes and workers all local",
        description="Start optimizer node(s) and worker processes on this machine and train a small GPT-style byte-level language model on the Python standard library's own source files. No GPU needed.",
    )
    demo.add_argument("--steps", type=positive_int, default=600, help="training steps (default: %(default)s)")
    demo.add_argument("--workers", type=positive_int, default=2, help="data-parallel worker processes (default: %(default)s)")
    demo.add_argument("--nodes", type=positive_int, default=1, help="optimizer-node processes (default: %(default)s)")
    demo.add_argument(
        "--wire-dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="dtype of gradients and parameters on the wire (default: %(default)s)",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed of the model and the data order (default: %(default)s)")
    demo.add_argument(
        "--moments",
        choices=MOMENT_FORMATS,
        default="fp32",
        help="how the nodes store AdamW's moments: fp32 (as torch does), bf16, or 8bit (blockwise, a scale per 256 elements); "
        "tensors under 4,096 elements stay fp32 (default: %(default)s)",
    )
    demo.add_argument("--layerwise", action="store_true", help="layer-wise mode: workers stream the blocks from the nodes instead of holding the model")


def _add_plan_memory_parser(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser(
        "plan-memory",
        help="RAM and disk each optimizer node needs for a model, before starting anything",
        description="Print what each node needs for its share of a job: RAM in memory, RAM and disk out of core (--state-dir/--memory-budget), so you know before you start. Nodes check the same figures when a job registers and refuse one they cannot hold.",
    )
    add_job_size_arguments(plan, optional=False)
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run_plan_memory(args: argparse.Namespace) -> int:
    import json

    from optimizer_node.state.memory_plan import available_memory

    try:
        job = job_size(args)
    except ValueError as exc:  # a --hf-config that cannot be read or counted: said with the file
        print(f"netoptim plan-memory: {exc}", file=sys.stderr)
        return 2
    assert job is not None, "plan-memory requires --params or --hf-config"
    share, needs = job.share, job.needs()
    # the parameter board, where workers share the node's host (netoptim node --same-host-board): what it adds
    # to the in-memory figure, less the copies it stands in for (the kept values, a 16-bit wire's cast)
    board = job.needs(board=True).ram_in_memory - needs.ram_in_memory
    available = available_memory()
    if args.json:
        report = {"params": job.params, "nodes": args.nodes, "per_node": needs.to_dict() | {"same_host_board": board}, "this_host_available_ram": available}
        print(json.dumps(report, indent=2))
        return 0
    gib = 2**30
    if args.hf_config:
        print(f"{args.hf_config}: {job.params:,} trainable parameters")
    print(
        f"{job.params:,} parameters over {args.nodes} node(s): about {share:,} per node, {args.workers} workers, {args.wire_dtype} on the wire, {job.moments} moments"
    )
    print(f"  in memory:   {needs.ram_in_memory / gib:8.1f} GiB RAM per node")
    print(f"               {board / gib:8.1f} GiB more for the parameter board where workers run on the node's host (--no-same-host-board: none)")
    if needs.ram_out_of_core is not None:
        print(f"  out of core: {needs.ram_out_of_core / gib:8.1f} GiB RAM per node with --memory-budget {args.memory_budget / gib:.1f}GiB")
    print(f"               {needs.disk_out_of_core / gib:8.1f} GiB disk per node under --state-dir (live state + {args.keep} checkpoint(s))")
    if available is not None:
        verdict = "fits" if needs.ram_in_memory <= available else "does NOT fit: use --state-dir/--memory-budget or more nodes"
        print(f"  this host has {available / gib:.1f} GiB available: in memory {verdict}")
    return 0


def _add_keygen_parser(subparsers: argparse._SubParsersAction) -> None:
    keygen = subparsers.add_parser(
        "keygen",
        help="make a CURVE key pair for the data plane",
        description="Write NAME.key (public: give it to peers; a node's allow-list is a directory of workers' .key files) and NAME.key_secret "
        "(keep it private) into DIR. Give a worker's key --ranks: the node then lets it register as those ranks only (FORBIDDEN otherwise); "
        "a key without ranks may register as any rank.",
    )
    keygen.add_argument("name", nargs="?", metavar="NAME", help="base name of the files, e.g. node0 or worker3")
    keygen.add_argument("--name", dest="name_option", metavar="NAME", help="the same as NAME")
    keygen.add_argument("--dir", default=".", help="where to write the two files (default: the current directory)")
    keygen.add_argument(
        "--ranks", type=_ranks, default=None, metavar="RANKS", help="the ranks a worker's key may register as: 3, 0,1 or 0-3 (a node's key needs none)"
    )


def _ranks(text: str) -> str:
    """A rank list like 3, 0,1 or 0-3,8, checked here so that a typo is a usage error."""
    from transport.zeromq.security import format_ranks, parse_ranks

    try:
        return format_ranks(parse_ranks(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run_keygen(args: argparse.Namespace) -> int:
    from transport.zeromq.security import generate_keypair

    if args.name and args.name_option and args.name != args.name_option:
        log.error("keygen: give the name once, as NAME or --name")
        return 2
    name = args.name or args.name_option
    if not name:
        log.error("keygen: give the key's name, e.g. netoptim keygen worker0 --ranks 0")
        return 2
    try:
        public, secret = generate_keypair(args.dir, name, ranks=args.ranks)
    except (OSError, ValueError) as exc:
        log.error("keygen failed: %s", exc)
        return 1
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    if args.ranks is not None:
        print(f"bound to rank(s) {args.ranks}: a node with {public.name} in its --curve-allow directory lets this key register as those ranks only")
    else:
        print("bound to no rank: fine for a node's key; a worker's key should be bound with --ranks, or any holder may register as any rank")
    return 0


def _add_export_parser(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser(
        "export",
        help="merge the nodes' checkpoints into one model state dict",
        description="Merge the checkpoints of all of a job's nodes (same step) into one ordinary state dict with the model's parameter names, loadable with model.load_state_dict.",
    )
    to = export.add_mutually_exclusive_group(required=True)
    to.add_argument("--to", metavar="FILE", help="one state dict file, ending in .safetensors or .pt (the whole model in this process)")
    to.add_argument(
        "--hf",
        metavar="DIR",
        help="a Hugging Face model directory that AutoModelForCausalLM.from_pretrained loads: config, sharded safetensors, "
        "written shard by shard (needs --hf-config)",
    )
    export.add_argument("--hf-config", metavar="PATH", help="with --hf: the model directory (or config.json) the job was trained from")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16", help="with --hf: the weights' dtype (default: %(default)s)")
    export.add_argument("--max-shard-size", type=size, default="5GB", metavar="SIZE", help="with --hf: the most bytes a shard holds (default: %(default)s)")
    export.add_argument(
        "checkpoints",
        nargs="+",
        metavar="CHECKPOINT",
        help="one per node: a checkpoint directory (step-N), or a node's --checkpoint-dir for its newest intact checkpoint",
    )


def run_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from optimizer_node.state.checkpoint import CheckpointError, resolve
    from optimizer_node.state.export import export

    if args.hf and not args.hf_config:
        log.error("export --hf needs --hf-config: the model directory (or config.json) the job was trained from")
        return 2
    if args.to and args.hf_config:
        log.error("--hf-config, --dtype and --max-shard-size are for --hf; --to writes the fp32 state dict")
        return 2
    try:
        checkpoints = [resolve(Path(path)) for path in args.checkpoints]
        if args.hf:
            from netoptim.integrations.hf_export import export_hf

            written = export_hf(checkpoints, Path(args.hf), config=Path(args.hf_config), dtype=args.dtype, max_shard_bytes=args.max_shard_size)
            step, numel, to = written["step"], written["params"], f"{args.hf} ({written['shards']} shard(s), {args.dtype})"
        else:
            step, numel = export(checkpoints, Path(args.to))
            to = args.to
    except (CheckpointError, ValueError, OSError) as exc:
        log.error("export failed: %s", exc)
        return 1
    print(f"exported step {step}: {numel:,} parameters from {len(checkpoints)} node checkpoint(s) to {to}")
    return 0


def _version() -> str:
    from netoptim import DISTRIBUTION, __version__

    return f"{__version__} (distribution {DISTRIBUTION})"


def parse_command_line(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default: ``sys.argv[1:]``); for ``node``, fill what its flags leave unset from
    ``--config FILE`` (exit 2 naming the key and line when the file is wrong)."""
    from netoptim.job.config_file import ConfigFileError, apply_config_file

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    node_parser = _subparser(parser, "node")
    sources = None
    if "node" in argv:
        try:
            sources = apply_config_file(node_parser, argv[argv.index("node") + 1 :], "node")
        except ConfigFileError as exc:
            node_parser.error(str(exc))
    args = parser.parse_args(argv)
    if args.command == "node":
        args.config_sources = sources
        args.node_parser = node_parser
    return args


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise AssertionError(name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="netoptim", description="netoptim: train models larger than their GPUs with the optimizer on CPU nodes in the network."
    )
    parser.add_argument("--version", action="version", version=f"netoptim {_version()}", help="print netoptim's version and exit")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars, here or in the processes this command starts (as TQDM_DISABLE=1 does)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging verbosity (default: %(default)s)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{node,demo,bench,cluster,plan,plan-memory,admin,doctor,export,keygen}")
    add_node_parser(subparsers)
    _add_demo_parser(subparsers)
    add_bench_parser(subparsers)
    add_cluster_parser(subparsers)
    _add_plan_memory_parser(subparsers)
    add_plan_parser(subparsers)
    add_admin_parser(subparsers)
    add_doctor_parser(subparsers)
    _add_export_parser(subparsers)
    _add_keygen_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``netoptim`` command; returns its exit status."""
    return _run_command(parse_command_line(argv))


def console() -> NoReturn:
    """The ``netoptim`` command and ``python -m netoptim``."""
    args = parse_command_line()
    try:
        code = _run_command(args)
    except KeyboardInterrupt:  # Ctrl-C: no traceback, the conventional status
        print(f"netoptim {args.command}: interrupted", file=sys.stderr)
        os._exit(130)
    except BrokenPipeError:  # `netoptim ... | head`: the reader left; nothing more to say
        os._exit(0)
    if args.command != "node":
        sys.exit(code)
    # A stopped node has closed its sockets, its store and its last checkpoint by now; what is left
    # is the interpreter tearing torch's modules down, ~0.4 s of every stop that frees nothing the
    # OS would not. Flush what is buffered and end the process here.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_command(args: argparse.Namespace) -> int:
    if args.no_progress:  # tqdm reads it in this process and in every worker and node started from it
        os.environ["TQDM_DISABLE"] = "1"
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.command == "node":
        return run_node(args)
    if args.command == "demo":
        from netoptim.cli.demo import run_demo

        return run_demo(args)
    if args.command == "keygen":
        return run_keygen(args)
    if args.command == "export":
        return run_export(args)
    if args.command == "admin":
        return run_admin(args)
    if args.command == "doctor":
        return run_doctor(args)
    if args.command == "plan-memory":
        return run_plan_memory(args)
    if args.command == "plan":
        return run_plan(args)
    if args.command == "cluster":
        from netoptim.cli.cluster import run_cluster_command

        return run_cluster_command(args)
    if args.command == "bench":
        from netoptim.benchmarks import run_benchmark

        return run_benchmark(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
