"""Where to cut a pipeline: stages balanced on measured per-block costs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockCost:
    """What one block costs for one micro-batch."""

    forward_s: float
    backward_s: float
    output_bytes: int
    param_bytes: int
    saved_bytes: int

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s


def balance(costs: Sequence[BlockCost], num_stages: int, *, max_stage_bytes: int | None = None, in_flight: int = 1) -> list[int]:
    """Cut points (first block of stages 1..P-1) minimizing the slowest stage's compute time.

    With ``max_stage_bytes``, a stage's parameters plus ``in_flight`` micro-batches of saved
    activations must fit in it; ``ValueError`` when no split does.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} blocks into {num_stages} stages: each stage needs at least one block")
    prefix_time = [0.0]
    prefix_bytes = [0]
    for cost in costs:
        prefix_time.append(prefix_time[-1] + cost.compute_s)
        prefix_bytes.append(prefix_bytes[-1] + cost.param_bytes + in_flight * cost.saved_bytes)

    def fits(a: int, b: int) -> bool:
        return max_stage_bytes is None or prefix_bytes[b] - prefix_bytes[a] <= max_stage_bytes

    inf = float("inf")
    # best[s][i]: the slowest stage of the best split of blocks [0, i) into s stages; classic linear partition
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                if best[s - 1][j] == inf or not fits(j, i):
                    continue
                worst = max(best[s - 1][j], prefix_time[i] - prefix_time[j])
                if worst < best[s][i]:
                    best[s][i], choice[s][i] = worst, j
    if best[num_stages][n] == inf:
        need = max(c.param_bytes + in_flight * c.saved_bytes for c in costs)
        raise ValueError(
            f"no split of {n} blocks into {num_stages} stages fits {max_stage_bytes} bytes per stage "
            f"(the largest block alone needs {need}): use more stages, smaller micro-batches, or more memory"
        )
    cuts = []
    i = n
    for s in range(num_stages, 1, -1):
        i = choice[s][i]
        cuts.append(i)
    return sorted(cuts)
