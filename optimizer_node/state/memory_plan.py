"""What a node needs, in RAM and on disk, before it allocates anything.

Per parameter a node keeps 12 bytes of state (fp32 master, exp_avg, exp_avg_sq) with fp32 moments,
8 with bf16 moments and about 6 with 8-bit ones (:mod:`optimizer_node.moments`; tensors under 4,096
elements keep fp32 moments). On top of that it
holds the gradients that arrived and are not applied yet: in full-model mode up to every worker's
whole share (workers push everything at the end of the step), in layer-wise mode at most each
worker's push window. A wire dtype other than fp32 adds an fp32 sum and a cast copy per resident
bucket (the cast on the board, where there is one). In memory it also keeps, for a worker that restarts in the middle of a step, the values of
each bucket before its last update, in the wire dtype (see :mod:`optimizer_node.intake.step_ledger`), or,
where same-host workers read from it, the parameter board: two versions of each bucket in the wire
dtype, the one before the current being what is kept (a 16-bit wire's cast is made there). Out
of core (where those are not kept), the state in RAM is the budget, and the disk holds the live state plus, for
each kept checkpoint, the versions it hard-links (at most one full copy each).
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from optimizer_node.moments.sizes import bytes_per_element

STATE_BYTES_PER_PARAM = 12
"""With fp32 moments (:func:`state_bytes_per_param` for the others)."""
FIXED_OVERHEAD_BYTES = 400 << 20
"""A node process with torch and ZeroMQ loaded and nothing registered: ~225 MiB measured, plus headroom."""


def state_bytes_per_param(moments: str = "fp32", block: int = 256) -> float:
    """Bytes of state per parameter: the fp32 master and both moments in format ``moments``
    (compressed ones counted as if every tensor were compressed)."""
    return 4.0 + bytes_per_element(moments, block)


@dataclass(frozen=True, slots=True)
class NodeNeeds:
    """One node's share of a job and what it costs."""

    params: int
    ram_in_memory: int
    ram_out_of_core: int | None  # with a memory budget
    disk_out_of_core: int

    def to_dict(self) -> dict:
        return asdict(self)


def node_needs(
    params: int,
    *,
    workers: int,
    wire_bytes: int = 4,
    layerwise: bool = False,
    push_window_bytes: int = 1 << 30,
    memory_budget: int | None = None,
    keep_checkpoints: int = 0,
    board: bool = False,
    masters_on_board: bool = True,
    state_bytes: int | None = None,
) -> NodeNeeds:
    """RAM and disk for a node owning ``params`` parameters of a job with ``workers`` workers;
    ``board``: with a parameter board for same-host workers (in memory only: two slots a bucket in the
    wire dtype, the one before the current holding what is kept for a restarted rank, and a 16-bit
    wire's cast written there instead of into a copy of its own; in fp32 the slots are the master
    values themselves, in place of the node's own copy, unless ``masters_on_board`` is False).
    ``state_bytes``: the share's state in bytes, where the moments are not fp32 (default 12 a parameter)."""
    gradients = workers * wire_bytes * params
    if layerwise:
        gradients = min(gradients, workers * push_window_bytes)
    state = STATE_BYTES_PER_PARAM * params if state_bytes is None else state_bytes
    cast = 0 if wire_bytes == 4 else (4 + (0 if board else wire_bytes)) * params  # fp32 sums and the cast copy of what goes out
    kept_for_restarts = 0 if board else wire_bytes * params
    board_bytes = 2 * wire_bytes * params if board else 0
    # fp32 in memory, the board's two slots are the master values: the node keeps no copy of its own
    masters_moved = 4 * params if board and masters_on_board and wire_bytes == 4 else 0
    in_memory = FIXED_OVERHEAD_BYTES + state + cast + gradients + kept_for_restarts + board_bytes - masters_moved
    out_of_core = None
    if memory_budget is not None:
        resident_fraction = min(1.0, memory_budget / state) if state else 1.0
        out_of_core = FIXED_OVERHEAD_BYTES + min(memory_budget, state) + int(cast * resident_fraction) + gradients + board_bytes
    return NodeNeeds(params, in_memory, out_of_core, state * (1 + keep_checkpoints))


def available_memory() -> int | None:
    """MemAvailable of this host (Linux), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def free_disk(path: str | Path) -> int:
    target = Path(path)
    while not target.exists():
        target = target.parent
    return shutil.disk_usage(target).free


def fit_problem(needs: NodeNeeds, *, state_dir: str | None, memory_budget: int | None, bucket_bytes: int, num_nodes: int) -> str | None:
    """Why this node cannot hold its share (with what to change), or None if it can."""
    gib = 2**30
    if state_dir is None:
        available = available_memory()
        if available is not None and needs.ram_in_memory > available:
            return (
                f"this node's share ({needs.params:,} parameters) needs about {needs.ram_in_memory / gib:.1f} GiB of RAM and {available / gib:.1f} GiB are available: "
                f"start the node with --state-dir DIR --memory-budget SIZE (out of core), or spread the job over more than {num_nodes} node(s); "
                "netoptim plan-memory shows the options"
            )
        return None
    assert memory_budget is not None
    if memory_budget < 2 * bucket_bytes:
        return f"--memory-budget {memory_budget / 2**20:.0f} MiB is less than two buckets ({2 * bucket_bytes / 2**20:.0f} MiB of state): raise it"
    free = free_disk(state_dir)
    live = needs.disk_out_of_core  # with no checkpoints kept: the live state
    if live > free:
        return f"the state of this node's share needs {live / 2**20:,.1f} MiB under {state_dir} and {free / 2**20:,.1f} MiB are free: free space or use another --state-dir"
    if needs.ram_out_of_core is not None:
        available = available_memory()
        if available is not None and needs.ram_out_of_core > available:
            return (
                f"even out of core this node needs about {needs.ram_out_of_core / gib:.1f} GiB of RAM ({available / gib:.1f} available): lower --memory-budget"
            )
    return None
