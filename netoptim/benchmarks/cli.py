"""``netoptim bench``: its subcommands and their flags (the benchmarks themselves live in ``netoptim/benchmarks/``)."""

from __future__ import annotations

import argparse

from netoptim.cli.arg_types import choice_list, niceness, non_negative_int, positive_int, positive_int_list, size, size_list, size_or_zero
from netoptim.cli.cluster import add_cluster_flags
from netoptim.cli.plan import add_model_flags
from netoptim.launch.niceness import SHARED_CORES_NICENESS

KEEP_FOR_BACKWARD_HELP = (
    "layer-wise: bytes of parameters of the last units that stay from forward to backward, which then does not fetch them again "
    "(offload(keep_for_backward=...); 4GiB, or 0: the last --prefetch + 1 units only) (default: %(default)s)"
)
WARMUP_HELP = (
    "untimed steps first: a node's first two updates of a bucket fault its memory in, and from the third it times its two "
    "update paths and keeps the faster (default: %(default)s)"
)


def _limits_file(path: str) -> dict:
    """``--limits-from``: the file's limits, checked as the command line is read."""
    from netoptim.benchmarks.gpu.limits_file import load_limits

    try:
        return load_limits(path)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_node_arg(parser: argparse.ArgumentParser, which: str, example: str) -> None:
    """``--node-arg``, repeatable: a flag passed on to ``which`` node(s) of a benchmark."""
    parser.add_argument(
        "--node-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help=f"a flag for {which}, as netoptim node takes it (repeat it for more; write it with '=': --node-arg={example}), to compare "
        "node settings; not --state-dir for more than one node (each clears the state files it finds at start)",
    )


def _add_moment_flags(parser: argparse.ArgumentParser, measured: str) -> None:
    """``--moments`` and ``--moment-block``: how the node stores the moments of the buckets ``measured``."""
    from protos.job.moment_formats import DEFAULT_MOMENT_BLOCK, MOMENT_BLOCKS, MOMENT_FORMATS

    parser.add_argument(
        "--moments",
        choices=MOMENT_FORMATS,
        default="fp32",
        help=f"how the node stores the optimizer's moments (a job's moments option): fp32 as torch does; bf16 or 8bit (blockwise, "
        f"an fp32 scale per block) compressed, {measured} (default: %(default)s)",
    )
    parser.add_argument(
        "--moment-block",
        type=int,
        choices=MOMENT_BLOCKS,
        default=DEFAULT_MOMENT_BLOCK,
        metavar="N",
        help=f"--moments 8bit: elements per block, each with its own scale; one of {', '.join(map(str, MOMENT_BLOCKS))} (default: %(default)s)",
    )


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    from protos.job.placement import DEFAULT_BUCKET_NUMEL

    bench = subparsers.add_parser(
        "bench",
        help="measure netoptim against a baseline in the same run; prints JSON",
        description='Benchmarks. Each prints one JSON object with a top-level "ratio" (netoptim over the baseline measured in the same run; higher is better) and the figures behind it, medians over --repeats.',
    )
    which = bench.add_subparsers(dest="bench", required=True, metavar="{optimizer,transport,train,gpu,offload,plan,cost,step,cluster,morph,convergence}")
    optimizer = which.add_parser("optimizer", help="node update rate (sum W gradients + AdamW + cast back) vs torch's fused AdamW")
    optimizer.add_argument("--numel", type=positive_int, default=16 << 20, help="parameters updated per step (default: %(default)s)")
    optimizer.add_argument("--workers", type=positive_int, default=2, help="gradients summed per update (default: %(default)s)")
    optimizer.add_argument(
        "--wire-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="dtype the gradients arrive in and the parameters leave in (default: %(default)s)",
    )
    optimizer.add_argument("--repeats", type=positive_int, default=7, help="timed repetitions; the median is reported (default: %(default)s)")
    optimizer.add_argument(
        "--rule",
        choices=["adamw", "adam", "sgd", "sgd-nesterov", "lion"],
        default="adamw",
        help="update rule: adamw (the compiled fast path, against torch's fused AdamW) or another rule's per-piece path against torch's fused optimizer of that rule (Lion: against fused AdamW) (default: %(default)s)",
    )
    optimizer.add_argument(
        "--bucket-numel",
        type=positive_int,
        default=DEFAULT_BUCKET_NUMEL,
        help="elements per bucket: the node updates one bucket a pass, torch's fused AdamW one tensor a bucket (default: %(default)s, RemoteAdamW's for a model of 64M parameters a node or more)",
    )
    _add_moment_flags(
        optimizer,
        "timed as the node's update of buckets that hold them so (--numel and --bucket-numel multiples of the block, or of 64 in bf16) against "
        "torch's fused fp32 AdamW and the same update with fp32 moments; adamw only",
    )
    transport = which.add_parser("transport", help="push+pull GB/s through a real node vs a plain TCP socket")
    transport.add_argument("--bytes", type=size, default=64 << 20, help="gradient bytes pushed (and the same pulled back) per measurement (default: 64MiB)")
    transport.add_argument("--bucket-bytes", type=size, default=4 << 20, help="bytes per message, as one bucket (default: 4MiB, the default bucket of fp32)")
    transport.add_argument(
        "--backend",
        choices=["zmq", "mooncake"],
        default="zmq",
        help="zmq: ZeroMQ over tcp:// (and the same-host ipc:// socket); mooncake: the Mooncake Transfer Engine over its tcp protocol (needs netoptim-train[rdma]) (default: %(default)s)",
    )
    transport.add_argument("--curve", action="store_true", help="zmq: also measure with CURVE encryption on (keys made for the run) and report its cost")
    transport.add_argument(
        "--connections", type=positive_int, default=1, help="zmq: TCP connections to the node, buckets spread over them (default: %(default)s)"
    )
    transport.add_argument("--repeats", type=positive_int, default=7, help="timed repetitions; the median is reported (default: %(default)s)")
    train = which.add_parser("train", help="GPT training tokens/s and worker peak RSS: torch DDP vs netoptim full-model vs layer-wise mode")
    train.add_argument(
        "--sizes",
        type=size_list,
        default=["small", "base"],
        help="comma-separated model sizes from small (3M), base (85M), 1b (1.0B; DDP and full mode are skipped where they cannot fit) (default: small,base)",
    )
    train.add_argument("--workers", type=positive_int, default=2, help="worker processes in every mode (default: %(default)s)")
    train.add_argument("--nodes", type=positive_int, default=1, help="optimizer nodes for the netoptim modes (default: %(default)s)")
    train.add_argument("--threads", type=positive_int, default=1, help="torch threads per worker (default: %(default)s)")
    train.add_argument("--batch", type=positive_int, default=4, help="sequences per worker per step (default: %(default)s)")
    train.add_argument("--seq", type=positive_int, default=64, help="tokens per sequence (at most the model's block size) (default: %(default)s)")
    train.add_argument(
        "--warmup",
        type=non_negative_int,
        default=3,
        help=WARMUP_HELP,
    )
    train.add_argument("--steps", type=positive_int, default=3, help="timed steps; the median step time is reported (default: %(default)s)")
    train.add_argument("--prefetch", type=non_negative_int, default=1, help="layer-wise: units fetched ahead of the one computing (default: %(default)s)")
    train.add_argument("--keep-for-backward", type=size_or_zero, default=0, metavar="SIZE", help=KEEP_FOR_BACKWARD_HELP)
    train.add_argument(
        "--bucket-numel",
        type=positive_int,
        default=None,
        help="netoptim modes: elements per bucket (default: RemoteAdamW's: 4M, halved down to 1M while a node would get fewer than 16 buckets)",
    )
    train.add_argument(
        "--overlap-forward",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="full model: RemoteAdamW(overlap_forward=True), each module's next forward waits for its own new values rather than step() for "
        "all of them (default: off: CPU workers on the nodes' host share its cores with them, and the overlap measured no gain there)",
    )
    train.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where workers compute; with cuda, worker k uses GPU k %% the GPU count, DDP runs over NCCL (one worker per GPU) and peak GPU memory is reported (default: %(default)s)",
    )
    train.add_argument(
        "--node-threads", type=positive_int, default=1, help="update threads per local node (more only where cores are free for them) (default: %(default)s)"
    )
    train.add_argument(
        "--node-nice",
        type=niceness,
        default=SHARED_CORES_NICENESS,
        metavar="N",
        help="niceness of the local nodes (netoptim node --nice), which share the workers' cores: at 0 a node's updates land on "
        "whichever worker is behind (default: %(default)s)",
    )
    train.add_argument(
        "--same-host-board",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whether the local nodes keep a parameter board their workers read from (netoptim node --same-host-board) "
        "(default: the node's: on in memory, off out of core)",
    )
    train.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="run every mode this many times, round after round; each mode reports its round of median tokens/s and the ratios are "
        "medians of each round's ratio (default: %(default)s)",
    )
    train.add_argument(
        "--out-of-core",
        type=size,
        default=None,
        metavar="BUDGET",
        help="the local nodes keep their state out of core, each in a directory of its own under the run's temporary directory, "
        "with this memory budget (netoptim node --state-dir ... --memory-budget BUDGET), to compare with nodes that hold it in memory "
        "(default: in memory)",
    )
    _add_node_arg(train, "every local node of the netoptim modes", "--pass-thread")
    add_gpu_parser(which)
    offload = which.add_parser("offload", help="out-of-core update rate vs the disk's own sequential read+write rate, and vs in memory")
    offload.add_argument("--numel", type=positive_int, default=64 << 20, help="parameters (default: %(default)s, 768 MiB of state)")
    offload.add_argument("--bucket-numel", type=positive_int, default=1 << 20, help="parameters per bucket (default: %(default)s)")
    offload.add_argument("--memory-budget", type=size, default=None, help="state held in memory at most (default: a quarter of the state)")
    offload.add_argument("--state-dir", default=None, help="where the state files go (default: a temporary directory under the current one)")
    offload.add_argument(
        "--io",
        choices=["sync", "buffered"],
        default="sync",
        help="sync: fdatasync each write and drop it from the page cache (disk speed, bounded cache); buffered: leave it to the page cache (default: %(default)s)",
    )
    offload.add_argument("--io-threads", type=positive_int, default=2, help="I/O threads of the store (default: %(default)s)")
    offload.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="timed steps and disk probes (with --moments: turns of each store, a step untimed and one timed); medians are reported (default: %(default)s)",
    )
    _add_moment_flags(
        offload,
        "run out of core beside a store with fp32 moments on the same buckets and budget, their disk bytes and update rates compared "
        "(no disk probe or in-memory run then; --bucket-numel a multiple of the block, or of 64 in bf16)",
    )
    train.add_argument("--timeout-s", type=positive_int, default=1800, help="give up on a mode after this long (default: %(default)s)")
    planned = which.add_parser("plan", help="netoptim plan's predicted step time vs the measured one, for a spread of configurations")
    add_model_flags(planned)
    planned.add_argument("--configs", type=positive_int, default=6, help="configurations measured, spread over the ranking (default: %(default)s)")
    planned.add_argument("--steps", type=positive_int, default=10, help="timed steps per configuration; the median is reported (default: %(default)s)")
    planned.add_argument("--warmup", type=non_negative_int, default=5, help="untimed steps first (default: %(default)s)")
    planned.add_argument("--calibration", default="", help="JSON calibration file to reuse or write (as netoptim plan --calibration)")
    planned.add_argument("--timeout-s", type=positive_int, default=600, help="give up on a configuration after this long (default: %(default)s)")
    cost = which.add_parser(
        "cost", help="the cost planner's step-time model (netoptim plan --catalog) vs measured step times here, for a spread of configurations"
    )
    add_model_flags(cost)
    cost.add_argument("--configs", type=non_negative_int, default=6, help="configurations measured here, spread over those possible (default: %(default)s)")
    cost.add_argument("--steps", type=positive_int, default=10, help="timed steps per configuration; the median is reported (default: %(default)s)")
    cost.add_argument("--warmup", type=non_negative_int, default=5, help="untimed steps first (default: %(default)s)")
    cost.add_argument("--profile", default="", help="a profile of netoptim plan --calibrate for this model (default: measure one now)")
    cost.add_argument("--timeout-s", type=positive_int, default=600, help="give up on a configuration after this long (default: %(default)s)")
    cost.add_argument(
        "--cluster-reports", default="", metavar="REPORTS", help="comma-separated netoptim cluster --json reports whose netoptim steps the model predicts too"
    )
    cost.add_argument(
        "--cluster-calibration", default="", metavar="REPORTS", help="comma-separated cluster reports whose link efficiencies the cluster predictions use"
    )
    step = which.add_parser("step", help="a bucket's cost per step, and each phase of a step on the worker and on the node; fewest vs most buckets")
    step.add_argument("--numel", type=positive_int, default=16 << 20, help="parameters trained, as one fp32 tensor (default: %(default)s)")
    step.add_argument(
        "--buckets",
        type=positive_int_list,
        default=[128, 1024, 4096],
        help="comma-separated bucket counts to split the parameters into; the fewest is the baseline (default: 128,1024,4096)",
    )
    step.add_argument("--threads", type=positive_int, default=1, help="torch threads of the worker (the node runs one) (default: %(default)s)")
    step.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps first (default: %(default)s)")
    step.add_argument("--steps", type=positive_int, default=5, help="timed steps per bucket count; the median is reported (default: %(default)s)")
    step.add_argument(
        "--wire-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of gradients and parameters on the wire (the node keeps fp32 master values either way) (default: %(default)s)",
    )
    _add_node_arg(step, "the node", "--pass-thread")
    morph = which.add_parser(
        "morph", help="an elastic job shrinking from 4 workers to 2 and growing to 3: bitwise against torch AdamW at the same widths, and each morph's pause"
    )
    morph.add_argument("--steps", type=positive_int, default=12, help="steps trained (default: %(default)s)")
    morph.add_argument("--leave-after", type=positive_int, default=3, help="two workers are preempted once this step is done (default: %(default)s)")
    morph.add_argument("--join-after", type=positive_int, default=7, help="a worker joins once this step is done (default: %(default)s)")
    morph.add_argument("--width", type=positive_int, default=32, help="hidden width of the small model trained (default: %(default)s)")
    add_convergence_parser(which)
    cluster = which.add_parser("cluster", help="tokens/s and bytes per link on an emulated cluster (root): netoptim vs torch FSDP and DDP over gloo")
    add_cluster_flags(cluster)
    for mode in which.choices.values():
        mode.add_argument(
            "--plot",
            default="",
            metavar="FILE.png",
            help="also draw the comparison into this PNG (matplotlib: pip install 'netoptim-train[plot]'); the JSON on stdout is unchanged",
        )


def add_convergence_parser(which: argparse._SubParsersAction) -> None:
    """``netoptim bench convergence``: a recipe's final loss with compressed moments against fp32 ones."""
    from protos.job.moment_formats import MOMENT_FORMATS

    convergence = which.add_parser(
        "convergence",
        help="the GPT recipe's (or a small transformers Llama's) final loss with the moments kept in 8 bits or bf16 on the nodes, over its loss "
        "with fp32 moments",
        description="Trains the GPT recipe (netoptim.recipes.train_gpt, as netoptim demo does) or, with --model llama, a small transformers "
        "Llama on the same data and schedule (netoptim.recipes.train_hf_llama) against local nodes for every --moments setting and seed, and "
        "reports each setting's final loss (mean of the last --window steps) and its ratio to fp32's with the same seed (median over seeds; "
        '"within_1pct" when it is within 1%). The top-level "ratio" is fp32\'s final loss over the worst compressed setting\'s (higher is '
        'better; 1: compression costs nothing); "model" says which model trained, and its shape.',
    )
    convergence.add_argument(
        "--model",
        choices=("gpt", "llama"),
        default="gpt",
        help="the model trained: gpt, the GPT recipe's (gpu_worker.models.GPT); llama, a transformers LlamaForCausalLM from a LlamaConfig of "
        "the shape flags below, byte-level (256 tokens), untied embeddings (needs transformers: pip install 'netoptim-train[integrations]') "
        "(default: %(default)s)",
    )
    convergence.add_argument("--steps", type=positive_int, default=1000, help="training steps of every run (default: %(default)s)")
    convergence.add_argument(
        "--moments",
        type=choice_list(MOMENT_FORMATS, "moment formats"),
        default=["fp32", "8bit", "bf16"],
        help="comma-separated moment formats to train with: fp32 (the baseline, always needed), 8bit, bf16 (default: fp32,8bit,bf16)",
    )
    convergence.add_argument(
        "--seeds",
        type=positive_int,
        default=3,
        help="runs per setting, with seeds 0, 1, ...: each sets the initial values and the data order (default: %(default)s)",
    )
    convergence.add_argument(
        "--window", type=positive_int, default=20, help="a run's final loss is the mean of its last this many steps' losses (default: %(default)s)"
    )
    convergence.add_argument("--workers", type=positive_int, default=2, help="worker processes of every run (default: %(default)s)")
    convergence.add_argument("--nodes", type=positive_int, default=1, help="local optimizer nodes of every run (default: %(default)s)")
    convergence.add_argument("--threads", type=positive_int, default=1, help="torch threads per worker (default: %(default)s)")
    convergence.add_argument("--n-layer", type=positive_int, default=4, help="transformer blocks, as the recipe's (default: %(default)s)")
    convergence.add_argument("--n-embd", type=positive_int, default=128, help="model width, as the recipe's (default: %(default)s)")
    convergence.add_argument("--n-head", type=positive_int, default=4, help="attention heads, as the recipe's (default: %(default)s)")
    convergence.add_argument(
        "--n-kv-head",
        type=positive_int,
        default=2,
        help="--model llama: key/value heads (grouped-query attention; --n-head must be a multiple) (default: %(default)s)",
    )
    convergence.add_argument(
        "--intermediate-size",
        type=non_negative_int,
        default=0,
        help="--model llama: width of the gated MLP (default: %(default)s, 4 x --n-embd; a multiple of 256 keeps its matrices whole blocks of 8-bit moments)",
    )
    convergence.add_argument("--block-size", type=positive_int, default=128, help="tokens per sequence, as the recipe's (default: %(default)s)")
    convergence.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warmup, then cosine decay), as the recipe's (default: %(default)s)")
    convergence.add_argument(
        "--global-batch", type=non_negative_int, default=0, help="sequences per step over all workers (default: %(default)s, the recipe's: 8 per worker)"
    )
    convergence.add_argument(
        "--bucket-numel",
        type=non_negative_int,
        default=0,
        help="parameters per bucket (default: %(default)s, RemoteAdamW's); a parameter split over buckets keeps fp32 moments for a piece "
        "that is not a whole number of blocks",
    )
    convergence.add_argument("--timeout-s", type=positive_int, default=3600, help="give up on a run after this long (default: %(default)s)")


def add_gpu_parser(which: argparse._SubParsersAction) -> None:
    from netoptim.benchmarks.gpu.mode_names import MODES
    from protos.job.placement import DEFAULT_BUCKET_NUMEL

    gpu = which.add_parser(
        "gpu",
        help="GPT training on one GPU: torch alone vs netoptim full and layer-wise vs DeepSpeed ZeRO-2/ZeRO-3 CPU offload (needs CUDA; says so and exits 0 without)",
        description="Each mode trains in a fresh process on GPU 0 with the same batches; the box's limits (pinned bandwidth each way, CPU AdamW at all cores, GPU compute alone) are measured in the same run. DeepSpeed modes need pip install 'netoptim-train[bench]'.",
    )
    gpu.add_argument(
        "--sizes",
        type=choice_list(("small", "350m", "1b", "3b", "7b", "largest"), "sizes"),
        default=["350m", "1b"],
        help="comma-separated GPT sizes: small (3M), 350m, 1b, 3b, 7b, or largest (the largest of those every offloaded mode fits on this host and GPU); torch alone is skipped where it cannot fit the GPU (default: 350m,1b)",
    )
    gpu.add_argument(
        "--dtypes",
        type=choice_list(("float32", "bfloat16"), "dtypes"),
        default=["float32", "bfloat16"],
        help="comma-separated: float32, bfloat16 (the model computes in it, netoptim's wire carries it, masters stay fp32) (default: float32,bfloat16)",
    )
    gpu.add_argument(
        "--modes",
        type=choice_list(MODES, "modes"),
        default=list(MODES),
        help=f"comma-separated, run in this order: {', '.join(MODES)} (compute: forward and backward alone; torch: AdamW on the GPU) (default: all)",
    )
    gpu.add_argument("--batch", type=positive_int, default=16, help="sequences per step (default: %(default)s)")
    gpu.add_argument("--seq", type=positive_int, default=64, help="tokens per sequence, at most 64 (the models' block size) (default: %(default)s)")
    gpu.add_argument(
        "--warmup",
        type=non_negative_int,
        default=3,
        help=WARMUP_HELP,
    )
    gpu.add_argument("--steps", type=positive_int, default=5, help="timed steps; their mean step time is reported (default: %(default)s)")
    gpu.add_argument("--prefetch", type=non_negative_int, default=2, help="layer-wise: units fetched ahead of the one computing (default: %(default)s)")
    gpu.add_argument("--keep-for-backward", type=size_or_zero, default=0, metavar="SIZE", help=KEEP_FOR_BACKWARD_HELP)
    gpu.add_argument(
        "--overlap-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="full model: RemoteAdamW(overlap_forward=True), each module's next forward waits for its own new values rather than step() for "
        "all of them, so the forward overlaps the node's last updates (default: on)",
    )
    gpu.add_argument(
        "--keep-step-gradients",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="full model: RemoteAdamW(keep_step_gradients=...): hold each step's gradients until its values are in, so that a node restarted "
        "mid-step gets them again; with --overlap-forward they then stay on the GPU through the next forward (off: let go once pushed, "
        "a gradient's size of GPU memory less) (default: on)",
    )
    gpu.add_argument(
        "--bucket-numel",
        type=positive_int,
        default=DEFAULT_BUCKET_NUMEL,
        help="netoptim: elements per bucket (default: %(default)s, RemoteAdamW's for a model of 64M parameters a node or more)",
    )
    gpu.add_argument("--nodes", type=positive_int, default=1, help="local optimizer nodes for the netoptim modes (default: %(default)s)")
    gpu.add_argument(
        "--node-threads",
        type=positive_int,
        default=None,
        help="update threads per local node (default: with --pin, one per CPU of the node's set; otherwise the CPUs less --worker-cpus, shared "
        "among the nodes; either way one less from 4 up, a CPU left for the node's I/O, and out of core (--node-arg=--state-dir=...) "
        "one less for each of the store's readers and writers while half are left, as netoptim node --threads says)",
    )
    gpu.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pin the training process to the first --worker-cpus CPUs and each local node to a disjoint set of the rest, NUMA nodes kept whole "
        "where the counts allow (netoptim node --cpus); DeepSpeed's modes run unpinned either way (default: on: unpinned, the node's "
        "update threads and the training process's take cores from each other and each bucket's pass waits for its slowest thread)",
    )
    gpu.add_argument(
        "--limits",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the box's limits first (bandwidth each way, CPU AdamW, the node's update pass; 30-60 s on a 16-core box); "
        "without them no fraction of the offload limit is reported, as for a second run on a box already measured (default: on)",
    )
    gpu.add_argument(
        "--limits-from",
        type=_limits_file,
        default=None,
        metavar="FILE.json",
        help="take the box's limits from an earlier run's --out report on the same box instead of measuring them (implies --no-limits): "
        "each mode's fraction of the offload limit without the 30-60 s (the compute mode must run in this run for it); refused when "
        "that run had another GPU or CPU count",
    )
    _add_node_arg(gpu, "every local node of the netoptim modes", "--no-same-host-board")
    gpu.add_argument("--worker-cpus", type=positive_int, default=2, help="CPUs left to the training process, pinned there with --pin (default: %(default)s)")
    gpu.add_argument("--copy-bytes", type=size, default=1 << 30, help="bytes per copy when measuring host-device bandwidth (default: 1GiB)")
    gpu.add_argument(
        "--adam-numel",
        type=positive_int,
        default=1 << 26,
        help="parameters when measuring CPU AdamW at all cores and the node's update pass (compiled loop and torch ops) at --node-threads, in --bucket-numel buckets (default: %(default)s)",
    )
    gpu.add_argument("--timeout-s", type=positive_int, default=900, help="give up on a mode after this long (default: %(default)s)")
    gpu.add_argument("--out", default="", metavar="FILE.json", help="also write the report there after every mode, so a run cut short keeps what it measured")
