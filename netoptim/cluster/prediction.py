"""Predicted step times of netoptim, FSDP and DDP on an emulated cluster, and the link efficiencies
earlier runs measured (:mod:`netoptim.planning.cluster_model` on the bytes of :mod:`netoptim.cluster.report`)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from pathlib import Path

from gpu_worker.models import GPTConfig
from netoptim.cluster.report import Shape, model_link_bytes
from netoptim.cluster.scaling import param_count
from netoptim.planning.cluster_model import MODES, ClusterTiming, StepPrediction, calibrate_efficiency, predict_step


class CalibrationError(ValueError):
    """A cluster report that cannot calibrate the prediction."""


def prediction_bytes(mode: str, config: GPTConfig, shape: Shape, *, host_groups: bool = True) -> dict[str, float]:
    """Payload bytes per link and step as the prediction counts them: netoptim with host groups when
    ``G > 1``; the collectives as rings over ranks numbered host by host, where one hop per host
    crosses its link (the table's ``G x`` per rank is their upper bound)."""
    return model_link_bytes(mode, config, param_count(config), shape, host_groups=host_groups and shape.workers_per_host > 1, ring=True)


def predict_cluster(
    config: GPTConfig, shape: Shape, timing: ClusterTiming, modes: Iterable[str] = MODES, *, host_groups: bool = True
) -> dict[str, StepPrediction]:
    """Each mode's predicted step on ``shape`` with ``timing`` (its ``ranks`` must be the shape's)."""
    if timing.ranks != shape.world_size:
        raise ValueError(f"timing for {timing.ranks} ranks, the shape has {shape.world_size}")
    return {mode: predict_step(mode, prediction_bytes(mode, config, shape, host_groups=host_groups), timing) for mode in modes}


def efficiencies_from_reports(paths: Iterable[str | Path]) -> dict[str, float]:
    """Median link efficiency per :func:`~netoptim.planning.cluster_model.bound_key` over the runs recorded in
    ``netoptim cluster --json`` / ``netoptim bench cluster`` reports."""
    found: dict[str, list[float]] = {}
    for path in paths:
        try:
            raw = json.loads(Path(path).read_text())
            config = GPTConfig(
                n_layer=raw["model"]["n_layer"], n_embd=raw["model"]["n_embd"], n_head=raw["model"]["n_head"], block_size=raw["model"]["block_size"]
            )
            cluster = raw["cluster"]
            shape = Shape(cluster["worker_hosts"], cluster["workers_per_host"], cluster["node_hosts"])
            timing = ClusterTiming(
                compute_s=float(raw["compute_probe_s"]),
                link_bit_s=float(raw["links"]["emulated_bit_s"]),
                node_link_bit_s=float(raw["links"].get("node_emulated_bit_s", 0.0)),
                ranks=shape.world_size,
                cores=float(raw.get("cores") or 0) or None,
                buckets=-(-param_count(config) // int(raw["netoptim_bucket_numel"])),
            )
            host_groups = bool(raw.get("host_groups", True))
            for mode, result in raw["results"].items():
                link_bytes = prediction_bytes(mode, config, shape, host_groups=host_groups)
                key, value = calibrate_efficiency(mode, link_bytes, timing, float(result["step_s"]))
                found.setdefault(key, []).append(value)
        except OSError as exc:
            raise CalibrationError(f"cannot read the cluster report {path}: {exc.strerror or exc}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise CalibrationError(f"{path} is not a report of netoptim cluster --json or netoptim bench cluster ({exc!r})") from None
    if not found:
        raise CalibrationError("the cluster reports hold no runs")
    return {key: statistics.median(values) for key, values in found.items()}
