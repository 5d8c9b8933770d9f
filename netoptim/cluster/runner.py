"""Running one training job on the emulated hosts (or on loopback, for comparison).

A :class:`Placement` says where a process of a host runs and how it is reached: :class:`ClusterPlacement`
puts it in the host's namespace, :class:`LoopbackPlacement` on this machine's loopback. The runner starts
the nodes (netoptim only) and ``workers_per_host`` ranks per worker host, lets them warm up, and times
the steps between its two barriers (see :mod:`netoptim.cluster.worker`), reading the link counters at each.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from netoptim.cluster.counters import LinkBytes, difference, read_counters
from netoptim.cluster.netns import in_namespace
from netoptim.cluster.topology import HOST_IFACE, Topology
from netoptim.launch.processes import NodeProcess, free_port

log = logging.getLogger(__name__)

NODE_PORT = 5555
RENDEZVOUS_PORT = 29500  # torch.distributed's store on worker host 0; the namespace is private, so no clash


@dataclass(frozen=True)
class JobSpec:
    """What to train and how long."""

    mode: str
    """``netoptim``, ``fsdp`` or ``ddp``."""
    workers_per_host: int = 1
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    block_size: int = 64
    micro_batch: int = 8
    warmup: int = 1
    steps: int = 5
    lr: float = 1e-3
    seed: int = 0
    threads: int = 1
    timeout_s: float = 600.0
    bucket_numel: int = 0
    """netoptim: parameters per bucket (0: RemoteAdamW's default)."""
    pace_window_bytes: int | None = None
    """netoptim: gradient bytes a pushing worker may have in flight whose values have not come back
    (``RemoteAdamW(pace_window_bytes=...)``); 0: no window; None: :data:`PACE_WINDOW_BUCKETS` buckets."""
    save_params: str = ""
    """Rank 0 writes its trained parameters here (``torch.save``)."""
    host_groups: bool = True
    """netoptim with several workers per host: they sum their gradients in shared memory and one of
    them talks to the nodes (:mod:`gpu_worker.hierarchical`); ``False``: every worker pushes its own."""

    def validate(self) -> None:
        if self.mode not in ("netoptim", "fsdp", "ddp"):
            raise ValueError(f"mode {self.mode!r}: one of netoptim, fsdp, ddp")
        if min(self.workers_per_host, self.n_layer, self.n_embd, self.n_head, self.block_size, self.micro_batch, self.steps, self.threads) < 1:
            raise ValueError(f"sizes, steps and threads must be positive: {self}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if self.warmup < 0 or self.bucket_numel < 0 or (self.pace_window_bytes or 0) < 0:
            raise ValueError(f"warmup, bucket_numel and pace_window_bytes must be >= 0, got {self.warmup}, {self.bucket_numel} and {self.pace_window_bytes}")

    def worker_args(self) -> list[str]:
        flags = dict(
            mode=self.mode, warmup=self.warmup, steps=self.steps, micro_batch=self.micro_batch, block_size=self.block_size, n_layer=self.n_layer,
            n_embd=self.n_embd, n_head=self.n_head, lr=self.lr, seed=self.seed, threads=self.threads, timeout_s=self.timeout_s,
            bucket_numel=self.bucket_numel, host_groups=int(self.host_groups), pace_window_bytes=self.pace_window_bytes or 0,
        )  # fmt: skip
        return [f"--{key.replace('_', '-')}={value}" for key, value in flags.items()] + ([f"--save-params={self.save_params}"] if self.save_params else [])


@dataclass
class JobResult:
    """What one job measured."""

    mode: str
    world_size: int
    timed_s: float
    """Wall time from ``go`` to the last rank's ``done``."""
    tokens_per_s: float
    step_s_per_rank: list[float]
    """Each rank's median step time."""
    loss: float
    bytes_per_step: dict[str, LinkBytes] = field(default_factory=dict)
    """Per host: bytes up and down its link per timed step (empty on loopback)."""


class ClusterPlacement:
    """Processes in the hosts' namespaces, reached at the hosts' addresses over the shaped links."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.worker_hosts = [h.name for h in topology.worker_hosts]
        self.node_hosts = [h.name for h in topology.node_hosts]
        self._hosts = {h.name: h for h in topology.hosts}

    def argv(self, host: str, argv: list[str]) -> list[str]:
        return in_namespace(self._hosts[host].namespace, argv)

    def node_listen(self, host: str) -> str:
        return f"tcp://{self._hosts[host].address}:{NODE_PORT}"

    # --insecure: a node on an address other than loopback refuses to run without CURVE. These
    # addresses exist only inside this run's private namespaces, whose one switch has no way out of
    # the machine, so nothing else can reach them; and CURVE's encryption would cost the nodes CPU that
    # the baselines (plain gloo) do not pay. --no-same-host-ipc: an ipc:// socket is a file, reachable
    # from every namespace of the machine, and would carry the bytes past the emulated links.
    node_args = ("--insecure", "--no-same-host-ipc")

    def rendezvous(self) -> tuple[str, int]:
        return self._hosts[self.worker_hosts[0]].address, RENDEZVOUS_PORT

    def gloo_interface(self) -> str:
        return HOST_IFACE

    def counters(self) -> dict[str, LinkBytes] | None:
        return read_counters(self.topology)


class LoopbackPlacement:
    """The same job on this machine's loopback: no namespaces, no shaping, no counters."""

    node_args = ("--no-same-host-ipc",)

    def __init__(self, worker_hosts: int, node_hosts: int) -> None:
        self.worker_hosts = [f"w{i}" for i in range(worker_hosts)]
        self.node_hosts = [f"n{i}" for i in range(node_hosts)]

    def argv(self, host: str, argv: list[str]) -> list[str]:
        return argv

    def node_listen(self, host: str) -> str:
        return "tcp://127.0.0.1:0"

    def rendezvous(self) -> tuple[str, int]:
        return "127.0.0.1", free_port()

    def gloo_interface(self) -> str:
        return "lo"

    def counters(self) -> dict[str, LinkBytes] | None:
        return None


Placement = ClusterPlacement | LoopbackPlacement


def run_job(placement: Placement, spec: JobSpec) -> JobResult:
    """Train ``spec`` on ``placement``'s hosts; every process it starts is stopped before it returns."""
    spec.validate()
    if spec.mode == "netoptim" and not placement.node_hosts:
        raise ValueError("netoptim needs at least one node host")
    with tempfile.TemporaryDirectory(prefix=f"netoptim-cluster-{spec.mode}-") as workdir:
        return _Job(placement, spec, Path(workdir)).run()


class _Job:
    def __init__(self, placement: Placement, spec: JobSpec, workdir: Path) -> None:
        self.placement, self.spec, self.workdir = placement, spec, workdir
        self.sync = workdir / "sync"
        self.sync.mkdir()
        self.world_size = len(placement.worker_hosts) * spec.workers_per_host
        self.nodes: list[NodeProcess] = []
        self.workers: list[subprocess.Popen] = []

    def run(self) -> JobResult:
        try:
            addresses = self._start_nodes() if self.spec.mode == "netoptim" else []
            self._start_workers(addresses)
            self._wait_for(lambda: all((self.sync / f"ready-{r}").exists() for r in range(self.world_size)), "the warm-up")
            before = self.placement.counters()
            started = time.monotonic()
            (self.sync / "go").touch()
            self._wait_for(lambda: all((self.sync / f"done-{r}.json").exists() for r in range(self.world_size)), "the timed steps")
            timed_s = time.monotonic() - started
            after = self.placement.counters()
            (self.sync / "release").touch()
            self._wait_for(lambda: all(w.poll() == 0 for w in self.workers), "the workers to exit")
            reports = [json.loads((self.sync / f"done-{r}.json").read_text()) for r in range(self.world_size)]
        finally:
            self._stop()
        tokens = self.world_size * self.spec.micro_batch * self.spec.block_size * self.spec.steps
        per_step = {}
        if before is not None and after is not None:
            per_step = {host: LinkBytes(d.up // self.spec.steps, d.down // self.spec.steps) for host, d in difference(after, before).items()}
        return JobResult(
            mode=self.spec.mode,
            world_size=self.world_size,
            timed_s=timed_s,
            tokens_per_s=tokens / timed_s,
            step_s_per_rank=[statistics.median(r["step_s"]) for r in reports],
            loss=reports[0]["loss"],
            bytes_per_step=per_step,
        )

    def _start_nodes(self) -> list[str]:
        for index, host in enumerate(self.placement.node_hosts):
            node = NodeProcess(
                self.workdir, name=f"node{index}", listen=self.placement.node_listen(host), extra_args=self.placement.node_args, log_level="WARNING"
            )
            node.command = self.placement.argv(host, node.command)
            self.nodes.append(node)
            node.start(timeout_s=120)
        return [node.address for node in self.nodes]

    def _start_workers(self, node_addresses: list[str]) -> None:
        master_addr, master_port = self.placement.rendezvous()
        script = [sys.executable, "-m", "netoptim.cluster.worker", f"--sync-dir={self.sync}", *self.spec.worker_args()]
        if node_addresses:
            script.append(f"--nodes={','.join(node_addresses)}")
        for rank in range(self.world_size):
            host = self.placement.worker_hosts[rank // self.spec.workers_per_host]
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(rank % self.spec.workers_per_host),
                "LOCAL_WORLD_SIZE": str(self.spec.workers_per_host),
                "NETOPTIM_CLUSTER_RUN": self.sync.name,  # names the host groups' shared files: unique per run
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "GLOO_SOCKET_IFNAME": self.placement.gloo_interface(),  # the host's own interface, not whatever the hostname resolves to
                "OMP_NUM_THREADS": str(self.spec.threads),
            }
            with open(self.workdir / f"worker{rank}.log", "wb") as log_file:
                self.workers.append(subprocess.Popen(self.placement.argv(host, script), env=env, stdout=log_file, stderr=subprocess.STDOUT))

    def _wait_for(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.spec.timeout_s
        while not condition():
            self._check_alive(what)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.spec.mode}: no end to {what} within {self.spec.timeout_s:.0f} s{self._logs()}")
            time.sleep(0.005)

    def _check_alive(self, what: str) -> None:
        errors = sorted(self.sync.glob("error-*"))
        failed = [(rank, w.returncode) for rank, w in enumerate(self.workers) if w.poll() not in (None, 0)]
        dead_nodes = [n.ready_file.stem for n in self.nodes if n.process is not None and n.process.poll() is not None]
        if errors or failed or dead_nodes:
            reason = (
                errors[0].read_text().splitlines()[0]
                if errors
                else f"worker rank {failed[0][0]} exited with {failed[0][1]}"
                if failed
                else f"{dead_nodes[0]} exited"
            )
            raise RuntimeError(f"{self.spec.mode} job failed during {what}: {reason}{self._logs()}")

    def _logs(self) -> str:
        parts = []
        for path in sorted(self.workdir.glob("*.log")):
            text = path.read_text(errors="replace").strip()
            if text:
                parts.append(f"\n--- {path.name} (end) ---\n{text[-1500:]}")
        return "".join(parts)

    def _stop(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                worker.terminate()
        for worker in self.workers:
            try:
                worker.wait(10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        for node in self.nodes:
            node.stop()
