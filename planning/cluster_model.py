"""Step time of a data-parallel job on a cluster of hosts joined by links of one rate: netoptim
(workers push to node hosts), FSDP (full shard) and DDP, from a calibration and the bytes each link
carries per step.

The calibration is one worker's forward and backward of its micro-batch, timed alone on its device
(``compute_s``). The bytes per link come from the model of docs/cluster.md (``cluster.report``).

- **Compute**: every rank computes its micro-batch; ranks that share ``cores`` (one host standing in
  for a cluster) share them, so the compute takes ``compute_s x max(1, ranks / cores)``.
- **Communication**: the busiest link's payload at the link's payload rate (the bit rate less the
  TCP/IP headers, 66 bytes per 1448-byte segment). FSDP's and DDP's collectives run after, or
  between, the computations they serve, so their step is compute plus communication.
- **netoptim** streams a step's ``B`` buckets: a node sends a bucket's parameters back only once
  every rank's gradient of it is in, so the parameters of the last bucket start after the gradients
  of all buckets, and the busiest link's time is stretched by ``1 + 1/B``; the nodes' update (CPU
  time per parameter, from the calibration) adds to it where the nodes have no cores to themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

TCP_PAYLOAD_SHARE = 1448 / (1448 + 66)
"""Payload per byte on an Ethernet link carrying full TCP segments (timestamps on)."""
MODES = ("netoptim", "fsdp", "ddp")


@dataclass(frozen=True)
class ClusterTiming:
    """What the prediction needs besides the bytes."""

    compute_s: float
    """One worker's forward and backward of its micro-batch, alone."""
    link_bit_s: float
    """Every link's rate, each way."""
    ranks: int
    """Worker ranks in all."""
    cores: float | None = None
    """Cores all ranks share (an emulated cluster on one machine); None: a device per rank."""
    buckets: int = 8
    """netoptim: buckets per step."""
    node_update_s: float = 0.0
    """netoptim: the nodes' update of a step, where it is not hidden."""

    def __post_init__(self) -> None:
        if self.compute_s <= 0 or self.link_bit_s <= 0 or self.ranks < 1 or self.buckets < 1:
            raise ValueError(f"compute time, link rate, ranks and buckets must be positive: {self}")
        if self.cores is not None and self.cores <= 0:
            raise ValueError(f"cores must be positive, got {self.cores}")

    @property
    def payload_bytes_per_s(self) -> float:
        return self.link_bit_s / 8 * TCP_PAYLOAD_SHARE


@dataclass(frozen=True)
class StepPrediction:
    mode: str
    step_s: float
    compute_s: float
    communication_s: float
    busiest_link: str

    def to_dict(self) -> dict:
        return {
            "predicted_step_s": self.step_s,
            "predicted_compute_s": self.compute_s,
            "predicted_communication_s": self.communication_s,
            "busiest_link": self.busiest_link,
        }


def predict_step(mode: str, link_bytes: dict[str, float], timing: ClusterTiming) -> StepPrediction:
    """The step time of ``mode`` whose links carry ``link_bytes`` payload bytes each way per step (by host)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    if not link_bytes:
        raise ValueError("no links")
    compute = timing.compute_s * (max(1.0, timing.ranks / timing.cores) if timing.cores else 1.0)
    busiest = max(link_bytes, key=lambda host: link_bytes[host])
    communication = link_bytes[busiest] / timing.payload_bytes_per_s
    if mode == "netoptim":
        communication = communication * (1 + 1 / timing.buckets) + timing.node_update_s
    return StepPrediction(mode, compute + communication, compute, communication, busiest)
