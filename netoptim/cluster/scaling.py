"""The link rate that gives this CPU the compute/communication balance of a target GPU cluster.

A step on the target takes ``t_gpu = FLOPs / target_flops`` to compute and ``bytes / target_link`` to
communicate. This CPU computes the same step in a measured ``t_cpu``; for communication to take the
same share of the step here, the emulated link must run at ``target_link x t_gpu / t_cpu``: the scale
is the CPU's effective FLOP/s over the target's, and the bytes cancel out, so one rate serves every
system compared (netoptim, FSDP, DDP), whatever each sends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import torch

from gpu_worker.models import GPT, GPTConfig

log = logging.getLogger(__name__)


def param_count(config: GPTConfig) -> int:
    """Trainable parameters of :class:`GPT` (untied head, biases, norms)."""
    per_block = 12 * config.n_embd**2 + 13 * config.n_embd
    return config.n_layer * per_block + (2 * config.vocab_size + config.block_size + 2) * config.n_embd


def step_flops(config: GPTConfig, sequences: int, seq_len: int) -> float:
    """FLOPs of forward + backward over ``sequences x seq_len`` tokens: 6 per weight a token meets in a
    matrix product (embedding lookups are not products) plus 12 x layers x width x context per token
    for the attention scores and their use (the usual transformer estimate)."""
    matmul_params = param_count(config) - (config.vocab_size + config.block_size) * config.n_embd
    tokens = sequences * seq_len
    return tokens * (6 * matmul_params + 12 * config.n_layer * config.n_embd * seq_len)


def measure_step_seconds(config: GPTConfig, sequences: int, seq_len: int, *, threads: int = 1, repeats: int = 5) -> float:
    """Fastest wall time of one forward + backward of a worker's batch on this CPU (after a warm-up).

    The fastest, not the median: on a shared machine the others' load only ever adds time, and the
    scale should reflect what the CPU can do, not how busy it was during the probe."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # as many as each worker process gets
    try:
        torch.manual_seed(0)
        model = GPT(config)
        idx = torch.randint(0, config.vocab_size, (sequences, seq_len))
        times = []
        for index in range(repeats + 1):
            started = time.perf_counter()
            _, loss = model(idx, idx)
            loss.backward()
            model.zero_grad(set_to_none=True)
            if index:  # the first call pays for allocation and kernel selection
                times.append(time.perf_counter() - started)
        return min(times)
    finally:
        torch.set_num_threads(previous)


@dataclass(frozen=True)
class LinkScaling:
    """How the emulated link rate was chosen."""

    target_link_gbit: float
    target_tflops: float
    step_flops: float
    """Per worker, forward + backward of its micro-batch."""
    cpu_step_s: float
    """This CPU's measured time for those FLOPs."""
    target_step_s: float
    """The target GPU's time for them: ``step_flops / target_tflops``."""
    scale: float
    """``target_step_s / cpu_step_s``: emulated rate over target rate."""
    emulated_bit_s: float

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if not self.target_tflops:
            return f"links at {self.emulated_bit_s / 1e6:.3g} Mbit/s, as given (no scaling)"
        cpu_gflops = self.step_flops / self.cpu_step_s / 1e9
        return (
            f"a worker's step is {self.step_flops / 1e9:.2f} GFLOP: {self.target_step_s * 1e3:.3g} ms at {self.target_tflops:g} TFLOP/s, "
            f"{self.cpu_step_s * 1e3:.0f} ms on this CPU ({cpu_gflops:.1f} GFLOP/s); scale {self.scale:.3g}: "
            f"{self.target_link_gbit:g} Gbit/s links are emulated at {self.emulated_bit_s / 1e6:.3g} Mbit/s"
        )


def scale_links(target_link_gbit: float, target_tflops: float, flops: float, cpu_step_s: float) -> LinkScaling:
    """The emulated rate for a target of ``target_tflops`` with ``target_link_gbit`` links; ``ValueError``
    when an input is not positive."""
    if min(target_link_gbit, target_tflops, flops, cpu_step_s) <= 0:
        raise ValueError(f"link rate, TFLOP/s, FLOPs and the CPU step time must be positive: {target_link_gbit}, {target_tflops}, {flops}, {cpu_step_s}")
    target_step_s = flops / (target_tflops * 1e12)
    scale = target_step_s / cpu_step_s
    return LinkScaling(target_link_gbit, target_tflops, flops, cpu_step_s, target_step_s, scale, target_link_gbit * 1e9 * scale)


def fixed_rate(rate_bit_s: float) -> LinkScaling:
    """A rate given outright (``--emulated-mbit``): no target, scale 1."""
    if rate_bit_s <= 0:
        raise ValueError(f"link rate must be positive, got {rate_bit_s}")
    return LinkScaling(rate_bit_s / 1e9, 0.0, 0.0, 0.0, 0.0, 1.0, rate_bit_s)
