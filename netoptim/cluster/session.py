"""One whole emulated-cluster run: scale the links, build the hosts, train each system, tear it all down.

Teardown runs whatever happens: on success, on an exception, on Ctrl-C (KeyboardInterrupt), and on
SIGTERM or SIGHUP, which are turned into an exception while the run holds the cluster. Only SIGKILL
skips it; then the trainers die with the runner (parent-death signal) and ``netoptim cluster
--cleanup`` removes the namespaces.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from gpu_worker.models import GPTConfig
from netoptim.cluster import netns, report, scaling, shaping, topology
from netoptim.cluster.cleanup import new_prefix
from netoptim.cluster.prediction import predict_cluster
from netoptim.cluster.runner import ClusterPlacement, JobSpec, run_job
from netoptim.planning.cluster_model import ClusterTiming

log = logging.getLogger(__name__)

BUCKETS_WHEN_AUTO = 32
PACE_WINDOW_BUCKETS = 6
"""netoptim's push window when none is given, in buckets: measured best of 4-16 on 4 x 2 + 2 hosts
(docs/cluster.md); it keeps the hosts' flows into a node's link in step."""


@dataclass(frozen=True)
class ClusterRun:
    """Everything one run needs."""

    shape: report.Shape
    job: JobSpec
    """The job's settings; its ``mode`` is replaced by each of ``modes``."""
    modes: tuple[str, ...] = ("netoptim",)
    target_link_gbit: float = 25.0
    target_tflops: float = 100.0
    emulated_mbit: float = 0.0
    """A link rate given outright; 0: scale the target's."""
    node_link_ratio: float = 1.0
    """The node hosts' link rate over the worker hosts' (CPU hosts with a faster port, or two)."""
    subnet: str = topology.DEFAULT_SUBNET
    link_efficiency: dict[str, float] = field(default_factory=dict)
    """The step prediction's link efficiencies (from earlier reports: ``--calibration``); none: ideal links."""

    @property
    def config(self) -> GPTConfig:
        return GPTConfig(block_size=self.job.block_size, n_layer=self.job.n_layer, n_embd=self.job.n_embd, n_head=self.job.n_head)

    def validate(self) -> None:
        self.job.validate()
        if not self.modes or any(mode not in ("netoptim", "fsdp", "ddp") for mode in self.modes):
            raise ValueError(f"modes {self.modes}: some of netoptim, fsdp, ddp")
        if "netoptim" in self.modes and self.shape.node_hosts < 1:
            raise ValueError("netoptim needs at least one node host")
        if self.emulated_mbit < 0 or self.node_link_ratio <= 0 or (not self.emulated_mbit and min(self.target_link_gbit, self.target_tflops) <= 0):
            raise ValueError("link rates and TFLOP/s must be positive")
        topology.plan_topology(self.shape.worker_hosts, self.shape.node_hosts, new_prefix(), self.subnet)  # counts and subnet


def auto_bucket_numel(params: int) -> int:
    """netoptim's bucket size when none is given: the model in about 32 buckets. A real model has
    hundreds at the default 4 MiB; with one, a node would receive every gradient before it could send
    anything back, serializing the two directions of its link (a toy-size effect, not a real one)."""
    return max(64, -(-params // BUCKETS_WHEN_AUTO // 64) * 64)


def link_scaling(run: ClusterRun) -> scaling.LinkScaling:
    """The emulated rate: given outright, or scaled from the target by this CPU's measured step."""
    if run.emulated_mbit:
        return scaling.fixed_rate(run.emulated_mbit * 1e6)
    flops = scaling.step_flops(run.config, run.job.micro_batch, run.job.block_size)
    cpu_s = scaling.measure_step_seconds(run.config, run.job.micro_batch, run.job.block_size, threads=run.job.threads)
    return scaling.scale_links(run.target_link_gbit, run.target_tflops, flops, cpu_s)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise ``SystemExit`` (so ``finally`` blocks run) like Ctrl-C
    raises ``KeyboardInterrupt``. Only the main thread can install handlers; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Ignore SIGINT/SIGTERM/SIGHUP while inside (teardown): a second Ctrl-C must not leave half a cluster."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_cluster(run: ClusterRun) -> dict:
    """Build the cluster, train each of ``run.modes`` on it and return the report (see :mod:`netoptim.cluster.report`).
    Raises ``PermissionError`` when not root, ``ValueError`` for bad settings."""
    run.validate()
    netns.require_root()
    params = scaling.param_count(run.config)
    job = run.job if run.job.bucket_numel else replace(run.job, bucket_numel=auto_bucket_numel(params))
    if job.pace_window_bytes is None:
        job = replace(job, pace_window_bytes=PACE_WINDOW_BUCKETS * job.bucket_numel * 4)
    links = link_scaling(run)
    log.info("%s", links.describe())
    # the step-time prediction's calibration: one worker's compute alone (the scaling probe's, or a probe now)
    compute_s = links.cpu_step_s or scaling.measure_step_seconds(run.config, run.job.micro_batch, run.job.block_size, threads=run.job.threads)
    topo = topology.plan_topology(run.shape.worker_hosts, run.shape.node_hosts, new_prefix(), run.subnet)
    results = {}
    with signals_raise():
        try:
            topology.build(topo)
            shaping.shape_all(topo, links.emulated_bit_s, node_rate_bit_s=links.emulated_bit_s * run.node_link_ratio)
            placement = ClusterPlacement(topo)
            for mode in run.modes:
                log.info("cluster %s: training with %s", topo.prefix, mode)
                results[mode] = run_job(placement, replace(job, mode=mode))
        finally:
            with signals_deferred():
                topology.teardown(topo)
    return _report(run, job, topo, links, params, results, compute_s)


def _report(run: ClusterRun, job: JobSpec, topo: topology.Topology, links: scaling.LinkScaling, params: int, results: dict, compute_s: float) -> dict:
    tokens_per_step = run.shape.world_size * job.micro_batch * job.block_size
    out: dict = {
        "cluster": {
            "prefix": topo.prefix,
            "subnet": topo.subnet,
            "worker_hosts": run.shape.worker_hosts,
            "workers_per_host": run.shape.workers_per_host,
            "node_hosts": run.shape.node_hosts,
            "world_size": run.shape.world_size,
        },
        "model": {"params": params, "n_layer": job.n_layer, "n_embd": job.n_embd, "n_head": job.n_head, "block_size": job.block_size},
        "batch": {
            "micro_batch": job.micro_batch,
            "global_batch": run.shape.world_size * job.micro_batch,
            "seq": job.block_size,
            "tokens_per_step": tokens_per_step,
        },
        "netoptim_bucket_numel": job.bucket_numel,
        "netoptim_pace_window_bytes": job.pace_window_bytes,
        "warmup": job.warmup,
        "steps": job.steps,
        "links": {**links.to_dict(), "node_emulated_bit_s": links.emulated_bit_s * run.node_link_ratio, "description": links.describe()},
        "compute_probe_s": compute_s,
        "cores": float(os.cpu_count() or 1),
        "host_groups": job.host_groups,
        "link_efficiency": run.link_efficiency,
        "results": {},
    }
    timing = ClusterTiming(
        compute_s=compute_s,
        link_bit_s=links.emulated_bit_s,
        node_link_bit_s=links.emulated_bit_s * run.node_link_ratio,
        ranks=run.shape.world_size,
        cores=float(os.cpu_count() or 1),
        buckets=-(-params // job.bucket_numel),
        efficiency=run.link_efficiency,
    )
    predictions = predict_cluster(run.config, run.shape, timing, results, host_groups=job.host_groups)
    for mode, result in results.items():
        host_groups = job.host_groups and run.shape.workers_per_host > 1
        model = report.model_link_bytes(mode, run.config, params, run.shape, host_groups=host_groups, ring=True)
        ideal = report.model_link_bytes(mode, run.config, params, run.shape, gloo=False, host_groups=host_groups)
        step_s = result.timed_s / job.steps
        predicted = predictions[mode]
        out["results"][mode] = {
            "tokens_per_s": result.tokens_per_s,
            "step_s": step_s,
            **predicted.to_dict(),
            "prediction_error": predicted.step_s / step_s - 1,
            "step_s_per_rank": result.step_s_per_rank,
            "loss": result.loss,
            "links": report.link_table(result, model, ideal),
        }
    return out
