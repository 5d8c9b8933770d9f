"""The bytes each link should carry per step (the model of docs/cluster.md), and the run's report.

Per step, with ``P`` parameters, ``b`` bytes per value on the wire, ``W`` ranks (``G`` per worker host)
and ``N`` node hosts; payload only (TCP/IP headers and ACKs add about 5% on the wire):

- netoptim: a worker sends its gradients and receives the parameters, ``P b`` each way; a node host
  receives every rank's gradients of its share and sends the parameters back, ``W P b / N`` each way.
- FSDP (full shard, one group of all ranks): each rank all-gathers every unit's parameters in forward
  and again in backward, and reduce-scatters the gradients, ``(W-1)/W P b`` each way per collective:
  ``3 (W-1)/W P b`` each way (the usual model: a ring reduce-scatter, as NCCL's). Two refinements
  measured here: FSDP2 keeps the root module's parameters (embeddings, final norm, head) gathered from
  forward to backward, so they are gathered once; and gloo's reduce-scatter moves as much as an
  all-reduce, ``2 (W-1)/W P b``.
- DDP: a ring all-reduce of the gradients, ``2 (W-1)/W P b`` each way.

A worker host's figure is ``G`` times a rank's: an upper bound when ``G > 1``, since collectives may
keep some of their hops inside a host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpu_worker.models import GPTConfig
from netoptim.planning.cluster_model import TCP_PAYLOAD_SHARE

if TYPE_CHECKING:
    from netoptim.cluster.runner import JobResult

WIRE_BYTES = 4  # fp32 everywhere: netoptim's default wire dtype, and what FSDP and DDP move here


@dataclass(frozen=True)
class Shape:
    """The cluster's counts."""

    worker_hosts: int
    workers_per_host: int
    node_hosts: int

    @property
    def world_size(self) -> int:
        return self.worker_hosts * self.workers_per_host


def root_params(config: GPTConfig) -> int:
    """Parameters outside the blocks: embeddings, final norm, head (FSDP's root unit)."""
    return (2 * config.vocab_size + config.block_size + 2) * config.n_embd


def per_rank_bytes(mode: str, params: int, root: int, world_size: int, *, gloo: bool = True) -> float:
    """Payload bytes one rank sends (and receives) per step, by the model above."""
    if mode == "netoptim":
        return params * WIRE_BYTES
    share = (world_size - 1) / world_size * WIRE_BYTES
    if mode == "ddp":
        return 2 * params * share
    if mode == "fsdp":
        if not gloo:
            return 3 * params * share
        return (2 * (params - root) + root + 2 * params) * share
    raise ValueError(f"mode {mode!r}: one of netoptim, fsdp, ddp")


def model_link_bytes(
    mode: str, config: GPTConfig, params: int, shape: Shape, *, gloo: bool = True, host_groups: bool = False, ring: bool = False
) -> dict[str, float]:
    """Payload bytes per step each way on every host's link, by host name (``w0``..., ``n0``...).
    ``host_groups`` (netoptim): a host's workers sum their gradients first, one flow per host.
    ``ring`` (FSDP, DDP): the collectives run as rings over ranks numbered host by host, so one hop
    per host crosses its link (none with one host); without it, ``G`` times a rank's (an upper bound)."""
    rank = per_rank_bytes(mode, params, root_params(config), shape.world_size, gloo=gloo)
    if mode != "netoptim" and ring:
        pushing = 1 if shape.worker_hosts > 1 else 0
    else:
        pushing = 1 if mode == "netoptim" and host_groups else shape.workers_per_host  # flows leaving each worker host
    links = {f"w{i}": pushing * rank for i in range(shape.worker_hosts)}
    for i in range(shape.node_hosts):
        links[f"n{i}"] = shape.worker_hosts * pushing * params * WIRE_BYTES / shape.node_hosts if mode == "netoptim" else 0.0
    return links


def link_table(result: JobResult, model: dict[str, float], ideal: dict[str, float]) -> dict[str, dict]:
    """Measured bytes per step on each link next to the model's: its payload, and the frames that carry
    it (``wire_model``: Ethernet, IP and TCP headers of full-size segments on top)."""
    table = {}
    for host, measured in result.bytes_per_step.items():
        expected = model.get(host, 0.0)
        wire = expected / TCP_PAYLOAD_SHARE
        table[host] = {
            "up_bytes_per_step": measured.up,
            "down_bytes_per_step": measured.down,
            "model_bytes_per_step": expected,
            "wire_model_bytes_per_step": wire,
            "ideal_model_bytes_per_step": ideal.get(host, 0.0),
            "up_over_model": measured.up / expected if expected else None,
            "down_over_model": measured.down / expected if expected else None,
            "up_over_wire_model": measured.up / wire if wire else None,
            "down_over_wire_model": measured.down / wire if wire else None,
        }
    return table


def format_text(report: dict) -> str:
    """The report for a terminal: one block per system, one line per link."""
    lines = [
        f"emulated cluster {report['cluster']['prefix']}: {report['cluster']['worker_hosts']} worker host(s) x {report['cluster']['workers_per_host']} "
        f"worker(s), {report['cluster']['node_hosts']} node host(s); GPT of {report['model']['params']:,} parameters, "
        f"{report['batch']['tokens_per_step']:,} tokens per step",
        f"links: {report['links']['description']}",
    ]
    node_rate = report["links"].get("node_emulated_bit_s", 0.0)
    if node_rate and abs(node_rate - report["links"]["emulated_bit_s"]) > 1:
        lines.append(f"node hosts' links: {node_rate / 1e6:.3g} Mbit/s each way")
    for mode, result in report["results"].items():
        lines.append(
            f"{mode}: {result['tokens_per_s']:,.0f} tokens/s ({result['step_s']:.3f} s per step, predicted {result['predicted_step_s']:.3f} s, "
            f"loss {result['loss']:.3f})"
        )
        for host, link in result["links"].items():
            model = link["model_bytes_per_step"]
            against = (
                f"; model {model / 1e6:.3f} MB payload each way, {link['wire_model_bytes_per_step'] / 1e6:.3f} MB in frames "
                f"(up {link['up_over_wire_model']:.3f}x, down {link['down_over_wire_model']:.3f}x)"
                if model
                else ""
            )
            lines.append(f"  {host}: up {link['up_bytes_per_step'] / 1e6:.3f} MB, down {link['down_bytes_per_step'] / 1e6:.3f} MB per step{against}")
    if "ratio" in report:
        lines.append(f"netoptim / FSDP tokens/s: {report['ratio']:.3f}")
    return "\n".join(lines)
