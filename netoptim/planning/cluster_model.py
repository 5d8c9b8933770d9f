"""Step time of a data-parallel job on a cluster of hosts joined by links (one rate for worker hosts,
possibly another for node hosts): netoptim
(workers push to node hosts), FSDP (full shard) and DDP, from a calibration and the bytes each link
carries per step.

The calibration is one worker's forward and backward of its micro-batch, timed alone on its device
(``compute_s``). The bytes per link come from the model of docs/cluster.md (``netoptim.cluster.report``).

- **Compute**: every rank computes its micro-batch; ranks that share ``cores`` (one host standing in
  for a cluster) share them, so the compute takes ``compute_s x max(1, ranks / cores)``.
- **Communication**: the busiest link's payload at the link's payload rate (the bit rate less the
  TCP/IP headers, 66 bytes per 1448-byte segment); the busiest is the one whose bytes take longest
  at its own rate. FSDP's and DDP's collectives run after, or
  between, the computations they serve, so their step is compute plus communication.
- **netoptim** streams a step's ``B`` buckets, ``B / N`` on each of ``N`` node hosts: a node sends a
  bucket's parameters back only once every rank's gradient of it is in, so the parameters of its last
  bucket start after the gradients of all of its buckets, and the busiest link's time is stretched by
  ``1 + N/B``; the nodes' update (CPU
  time per parameter, from the calibration) adds to it where the nodes have no cores to themselves.
- **Efficiency**: no system reaches its link's rate all through a step (TCP's ramp after each
  pause, collectives one after another, the order in which a node can answer). Each system's
  measured share of the ideal time, from earlier runs on the same links (:func:`calibrate_efficiency`,
  ``netoptim plan --cluster ... --cluster-calibration REPORT``), divides its ideal communication time;
  netoptim's is kept apart for steps bound by a node host's link and by a worker host's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TCP_PAYLOAD_SHARE = 1448 / (1448 + 66)
"""Payload per byte on an Ethernet link carrying full TCP segments (timestamps on)."""
MODES = ("netoptim", "fsdp", "ddp")


@dataclass(frozen=True)
class ClusterTiming:
    """What the prediction needs besides the bytes."""

    compute_s: float
    """One worker's forward and backward of its micro-batch, alone."""
    link_bit_s: float
    """Every worker host's link rate, each way (and every node host's, unless ``node_link_bit_s``)."""
    ranks: int
    """Worker ranks in all."""
    cores: float | None = None
    """Cores all ranks share (an emulated cluster on one machine); None: a device per rank."""
    buckets: int = 8
    """netoptim: buckets per step."""
    node_update_s: float = 0.0
    """netoptim: the nodes' update of a step, where it is not hidden."""
    node_link_bit_s: float = 0.0
    """The node hosts' link rate, each way; 0: ``link_bit_s``."""
    efficiency: dict[str, float] = field(default_factory=dict)
    """Measured share of the ideal communication time each system reaches, by :func:`bound_key`
    (from earlier runs: :func:`calibrate_efficiency`); 1.0 where none was measured."""

    def __post_init__(self) -> None:
        if self.compute_s <= 0 or self.link_bit_s <= 0 or self.ranks < 1 or self.buckets < 1:
            raise ValueError(f"compute time, link rate, ranks and buckets must be positive: {self}")
        if self.node_link_bit_s < 0:
            raise ValueError(f"the node hosts' link rate must be positive (or 0: the workers'), got {self.node_link_bit_s}")
        if self.cores is not None and self.cores <= 0:
            raise ValueError(f"cores must be positive, got {self.cores}")
        if any(not 0 < value <= 2 for value in self.efficiency.values()):
            raise ValueError(f"link efficiencies must be in (0, 2]: {self.efficiency}")

    def efficiency_of(self, key: str) -> float:
        """The calibrated efficiency for ``key``, else the mean of the same system's others, else 1."""
        if key in self.efficiency:
            return self.efficiency[key]
        mode = key.split("/")[0]
        same = [value for other, value in self.efficiency.items() if other.split("/")[0] == mode]
        return sum(same) / len(same) if same else 1.0

    @property
    def payload_bytes_per_s(self) -> float:
        """A worker host's link, payload bytes per second each way."""
        return self.link_bit_s / 8 * TCP_PAYLOAD_SHARE

    def payload_rate_of(self, host: str) -> float:
        """Host ``host``'s link (``w...`` a worker host, ``n...`` a node host), payload bytes per second."""
        rate = self.node_link_bit_s if host.startswith("n") and self.node_link_bit_s else self.link_bit_s
        return rate / 8 * TCP_PAYLOAD_SHARE


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
    busiest = max(link_bytes, key=lambda host: link_bytes[host] / timing.payload_rate_of(host))
    communication = link_bytes[busiest] / timing.payload_rate_of(busiest)
    if mode == "netoptim":
        nodes = max(1, sum(1 for host in link_bytes if host.startswith("n")))
        communication = communication * (1 + nodes / timing.buckets) + timing.node_update_s
    communication /= timing.efficiency_of(bound_key(mode, busiest))
    return StepPrediction(mode, compute + communication, compute, communication, busiest)


def bound_key(mode: str, busiest_host: str) -> str:
    """What a calibrated efficiency is kept under: the system, and for netoptim which links bound
    the step (a node host's, ``n...``, carrying several workers' flows, or a worker host's, whose
    parameters come back only after its gradients went out)."""
    if mode != "netoptim":
        return mode
    return f"{mode}/{'node' if busiest_host.startswith('n') else 'worker'}-link"


def calibrate_efficiency(mode: str, link_bytes: dict[str, float], timing: ClusterTiming, measured_step_s: float) -> tuple[str, float]:
    """``(key, efficiency)`` of one measured run: the ideal communication time over the measured
    step less the compute (clamped to (0, 2])."""
    ideal = predict_step(mode, link_bytes, ClusterTiming(**{**timing.__dict__, "efficiency": {}}))
    spent = measured_step_s - ideal.compute_s
    efficiency = ideal.communication_s / spent if spent > 0 else 2.0
    return bound_key(mode, ideal.busiest_link), min(2.0, max(1e-3, efficiency))
