"""Prometheus metrics of a node, served on ``/metrics`` (``--metrics-port``) with prometheus_client.

Every node has a :class:`~prometheus_client.CollectorRegistry` of its own (not the library's global
default), so several nodes in one process (tests) never share or clash over series. The registry
holds the standard process, platform and garbage-collector collectors and the node's own series.

Cost on the daemon thread: each message increments a counter (O(1), one short lock), each bucket
update and each step observes a histogram. Everything that needs to look at the node's state
(workers heard from recently, paused, draining, checkpoint age, the non-finite statistics) is
computed only when ``/metrics`` is scraped, on the HTTP thread.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from optimizer_node.control import StepTimings
from optimizer_node.intake.non_finite import NonFiniteStats
from optimizer_node.state.storage import no_store_io
from transport.interface import no_shared_memory

log = logging.getLogger(__name__)

disable_created_metrics()  # no ``*_created`` series: the process start time already says when counting began

UPDATE_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds from a bucket's first gradient of a step to its update being sent back."""

STEP_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Seconds of a whole step at this node (first gradient of the step to its last bucket updated)."""

WORKER_SILENT_AFTER_S = 300.0
"""A rank not heard from for this long no longer counts in ``netoptim_workers_connected``. ZeroMQ does
not tell the node that a worker closed its connection, so the rank table only knows when each rank
last spoke; 300 s is the worker's own default wait (``RemoteAdamW(timeout_s=300)``): a worker silent
for longer has given up or gone. The environment variable ``NETOPTIM_METRICS_WORKER_SILENT_S``
overrides it (tests use a second)."""

STEP_PARTS = ("wall", "reduce", "update", "send")


def worker_silent_after_s() -> float:
    """The threshold in force: ``NETOPTIM_METRICS_WORKER_SILENT_S`` if set to a positive number, else :data:`WORKER_SILENT_AFTER_S`."""
    raw = os.environ.get("NETOPTIM_METRICS_WORKER_SILENT_S", "")
    try:
        value = float(raw)
    except ValueError:
        return WORKER_SILENT_AFTER_S
    return value if value > 0 and math.isfinite(value) else WORKER_SILENT_AFTER_S


def _never() -> bool:
    return False


def _no_checkpoint() -> float | None:
    return None


def _no_workers() -> Iterable[float]:
    return ()


_SAME_HOST_SERIES = (  # (family, name, help, key of ServerEndpoint.shared_memory())
    (GaugeMetricFamily, "netoptim_same_host_windows", "Same-host worker connections whose payloads go through shared windows.", "connections"),
    (
        CounterMetricFamily,
        "netoptim_same_host_shared_bytes_sent",
        "Payload bytes written into same-host workers' windows or sent as places on the parameter board (not sent on a socket).",
        "written_bytes",
    ),
    (
        CounterMetricFamily,
        "netoptim_same_host_shared_bytes_received",
        "Payload bytes read from same-host workers' windows (not received on a socket).",
        "read_bytes",
    ),
    (GaugeMetricFamily, "netoptim_same_host_board_bytes", "Size of the job's parameter board for same-host workers (0: none).", "board_bytes"),
    (
        CounterMetricFamily,
        "netoptim_same_host_board_written_bytes",
        "Payload bytes written onto the parameter board (once per bucket version), by the update pass in place or copied there.",
        "board_written_bytes",
    ),
    (
        CounterMetricFamily,
        "netoptim_same_host_board_copied_bytes",
        "Of the bytes written onto the parameter board, those copied there on the send path (values the update pass did not write in place).",
        "board_copied_bytes",
    ),
    (
        CounterMetricFamily,
        "netoptim_same_host_board_referenced_bytes",
        "Payload bytes sent to same-host workers as places on the parameter board.",
        "board_referenced_bytes",
    ),
)


class _ScrapeTimeCollector(Collector):
    """The series computed from the node's state when scraped: workers heard from recently, paused,
    draining, checkpoint age and the non-finite statistics."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        now = time.time()
        yield GaugeMetricFamily(
            "netoptim_workers_connected",
            f"Worker ranks registered with this node and heard from in the last {m.silent_after_s:g} s.",
            value=sum(1 for seen in m.workers_last_seen() if now - seen <= m.silent_after_s),
        )
        yield GaugeMetricFamily(
            "netoptim_state_at_risk",
            "1 when a crash of this node loses its job's state: no checkpoint directory, or no periodic checkpoints (--checkpoint-every).",
            value=int(m.state_at_risk),
        )
        moments, state_bytes = m.moments()
        if moments:
            family = GaugeMetricFamily("netoptim_moments", "1, labelled with how the job's moments are stored (fp32, bf16, 8bit).", labels=["format"])
            family.add_metric([moments], 1)
            yield family
            yield GaugeMetricFamily("netoptim_state_bytes", "Bytes of the owned buckets' parameters and optimizer state, as stored.", value=state_bytes)
        yield GaugeMetricFamily("netoptim_paused", "1 while an operator has paused updates, else 0.", value=int(bool(m.paused())))
        yield GaugeMetricFamily("netoptim_draining", "1 once a drain was asked for (no gradients after its last step), else 0.", value=int(bool(m.draining())))
        created = m.last_checkpoint_unix()
        if created is not None:
            yield GaugeMetricFamily("netoptim_checkpoint_age_seconds", "Seconds since the newest checkpoint was written.", value=max(0.0, now - created))
        yield CounterMetricFamily("netoptim_bytes_received", "Tensor payload bytes received from workers.", value=m.bytes_in)
        yield CounterMetricFamily("netoptim_bytes_sent", "Tensor payload bytes sent to workers.", value=m.bytes_out)
        shared = m.shared_memory()
        for family, name, text, key in _SAME_HOST_SERIES:
            yield family(name, text, value=shared[key])
        yield GaugeMetricFamily(
            "netoptim_master_values_on_board_bytes",
            "fp32 master parameters kept on the parameter board (each update writes them beside the version it reads), not in memory of their own.",
            value=m.master_bytes_on_board(),
        )
        io = m.store_io()
        yield CounterMetricFamily("netoptim_state_read_bytes", "Out of core: bytes of state read from the state files.", value=io["bytes_read"])
        yield CounterMetricFamily("netoptim_state_written_bytes", "Out of core: bytes of state written to the state files.", value=io["bytes_written"])
        yield CounterMetricFamily(
            "netoptim_curve_refused_connections", "Data-plane handshakes refused: the CURVE key is not in --curve-allow.", value=m.curve_refused()
        )
        yield from self._non_finite()

    def _non_finite(self) -> Iterator[Metric]:
        """Gradients with NaN/inf: refused pushes, skipped steps, and the last event (-1: none, or not seen here)."""
        stats = self._metrics.non_finite.snapshot()
        last = stats["last"] or {"step": -1, "rank": -1, "bucket_id": -1}
        policy = GaugeMetricFamily("netoptim_non_finite_policy", "The node's --non-finite policy (1 for the one in force).", labels=["policy"])
        for name in ("refuse", "skip"):
            policy.add_metric([name], int(name == stats["policy"]))
        yield policy
        yield CounterMetricFamily(
            "netoptim_non_finite_refused", "Pushes refused because the gradient held NaN or inf (--non-finite refuse).", value=stats["refused_pushes"]
        )
        yield CounterMetricFamily(
            "netoptim_non_finite_skipped_steps",
            "Steps skipped on every bucket because a gradient held NaN or inf (--non-finite skip).",
            value=stats["skipped_steps"],
        )
        yield CounterMetricFamily(
            "netoptim_non_finite_vouched_pushes",
            "Pushes taken on the worker's word that the gradient is finite (its device summed it; --non-finite-check worker).",
            value=stats["vouched_pushes"],
        )
        yield GaugeMetricFamily("netoptim_non_finite_last_step", "Step of the last refused or skipped non-finite gradient (-1: none).", value=last["step"])
        yield GaugeMetricFamily(
            "netoptim_non_finite_last_rank", "Rank whose gradient was the last non-finite one (-1: none, or seen by another node).", value=last["rank"]
        )
        yield GaugeMetricFamily(
            "netoptim_non_finite_last_bucket", "Bucket of the last non-finite gradient (-1: none, or seen by another node).", value=last["bucket_id"]
        )


class NodeMetrics:
    """The series of one node, on a registry of its own (:attr:`registry`).

    The daemon thread calls :meth:`received`, :meth:`sent`, :meth:`rejected_message`,
    :meth:`bucket_updated` and :meth:`step_completed`; the callables given here are read only at scrape
    time, from the HTTP thread, so each must be a cheap, thread-safe read of the node's state:

    - ``workers_last_seen``: unix time each registered rank was last heard from;
    - ``paused`` / ``draining``: whether an operator paused updates / asked for a drain;
    - ``last_checkpoint_unix``: when the newest checkpoint was written (``None``: none yet);
    - ``shared_memory``: same-host connections with shared windows and the bytes through them;
    - ``store_io``: an out-of-core node's state bytes read and written
      (:meth:`~optimizer_node.state.storage.BucketStore.io_counters`);
    - ``curve_refused``: data-plane connections whose CURVE key the allow-list refused;
    - ``master_bytes_on_board``: fp32 master values kept on the parameter board
      (:meth:`~optimizer_node.state.storage.BucketStore.master_bytes_on_board`).
    """

    def __init__(
        self,
        non_finite: NonFiniteStats | None = None,
        *,
        workers_last_seen: Callable[[], Iterable[float]] = _no_workers,
        paused: Callable[[], bool] = _never,
        draining: Callable[[], bool] = _never,
        last_checkpoint_unix: Callable[[], float | None] = _no_checkpoint,
        shared_memory: Callable[[], dict[str, int]] = no_shared_memory,
        store_io: Callable[[], dict[str, int]] = no_store_io,
        curve_refused: Callable[[], int] = lambda: 0,
        master_bytes_on_board: Callable[[], int] = lambda: 0,
        state_at_risk: bool = False,
        moments: Callable[[], tuple[str, int]] = lambda: ("", 0),
        silent_after_s: float | None = None,
    ) -> None:
        self.non_finite = non_finite if non_finite is not None else NonFiniteStats("refuse")
        self.workers_last_seen = workers_last_seen
        self.paused = paused
        self.draining = draining
        self.last_checkpoint_unix = last_checkpoint_unix
        self.shared_memory = shared_memory
        self.store_io = store_io
        self.curve_refused = curve_refused
        self.master_bytes_on_board = master_bytes_on_board
        self.state_at_risk = state_at_risk
        self.moments = moments
        self.silent_after_s = worker_silent_after_s() if silent_after_s is None else silent_after_s
        self.registry = registry = CollectorRegistry()  # no auto_describe: the scrape-time collector must not run before the daemon is built
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        # Counted per message on the daemon's hot path as plain integers (a prometheus Counter takes a
        # lock each time), read at scrape time; each bucket's update latency waits for its step's end.
        self.bytes_in = 0
        self.bytes_out = 0
        self._latencies: list[float] = []
        self._steps = Counter("netoptim_steps", "Steps completed (every owned bucket updated).", registry=registry)
        self._rejected = Counter("netoptim_rejected_messages", "Messages answered with an error.", registry=registry)
        self._step = Gauge("netoptim_step", "The step every owned bucket has reached.", registry=registry)
        self._step_duration = Histogram("netoptim_step_duration_seconds", "Wall time of a step at this node.", buckets=STEP_DURATION_BUCKETS, registry=registry)
        last = Gauge("netoptim_last_step_seconds", "Time of the last step, by part.", ["part"], registry=registry)
        total = Counter("netoptim_step_seconds", "Time spent in steps, by part.", ["part"], registry=registry)
        self._last_step = {part: last.labels(part) for part in STEP_PARTS}
        self._step_seconds = {part: total.labels(part) for part in STEP_PARTS}
        self._update_latency = Histogram(
            "netoptim_bucket_update_latency_seconds",
            "From a bucket's first gradient of a step to its new values leaving.",
            buckets=UPDATE_LATENCY_BUCKETS,
            registry=registry,
        )
        registry.register(_ScrapeTimeCollector(self))

    # ---------------------------------------------------------------- the daemon thread

    def received(self, nbytes: int) -> None:
        """A message with ``nbytes`` of tensor payload arrived."""
        self.bytes_in += nbytes

    def sent(self, nbytes: int) -> None:
        """A message with ``nbytes`` of tensor payload left."""
        self.bytes_out += nbytes

    def rejected_message(self) -> None:
        """A message was answered with an error."""
        self._rejected.inc()

    def bucket_updated(self, latency_s: float, *, ends_step: bool = False) -> None:
        """A bucket's update went out ``latency_s`` after the first gradient of its step arrived. The
        histogram takes the step's latencies once its last bucket went out (``ends_step``): between
        steps, off the path the workers wait on."""
        self._latencies.append(latency_s)
        if ends_step:
            latencies, self._latencies = self._latencies, []
            for latency in latencies:
                self._update_latency.observe(latency)

    def step_reached(self, step: int) -> None:
        """Every owned bucket is at ``step`` (after a step, or when a node resumes from a checkpoint)."""
        self._step.set(step)

    def step_completed(self, timings: StepTimings, step: int | None = None) -> None:
        """A step ended (reaching ``step`` when given) and took ``timings``."""
        self._steps.inc()
        if step is not None:
            self._step.set(step)
        self._step_duration.observe(timings.wall_s)
        for part in STEP_PARTS:
            seconds = getattr(timings, part + "_s")
            self._last_step[part].set(seconds)
            self._step_seconds[part].inc(max(0.0, seconds))

    # ---------------------------------------------------------------- the HTTP thread

    def render(self) -> bytes:
        """The Prometheus text exposition format of every series of this node."""
        return generate_latest(self.registry)


class _ExclusiveHTTPServer(ThreadingHTTPServer):
    """An HTTP server that owns its port alone."""

    allow_reuse_address = True  # SO_REUSEADDR: a restart binds despite old connections in TIME_WAIT; Linux still allows one listener per port
    allow_reuse_port = False  # SO_REUSEPORT would let a second process listen on the same port and take half the scrapes
    metrics: NodeMetrics | None = None  # what /metrics renders, set by MetricsServer.start


class _Handler(BaseHTTPRequestHandler):
    server: _ExclusiveHTTPServer

    def do_GET(self) -> None:
        if self.path.split("?")[0] != "/metrics":
            self.send_error(404, "only /metrics is served")
            return
        metrics = self.server.metrics
        assert metrics is not None, "served only after MetricsServer.start"
        body = metrics.render()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # scrapes are not worth a log line
        return


class MetricsServer:
    """Serves ``/metrics`` over HTTP from a background thread. Constructing it binds ``host:port``
    exclusively (port 0: the OS picks), so a node learns that the port is taken before it loads
    anything; :meth:`start` then serves a node's metrics there.

    Raises ``ValueError`` for a port outside [0, 65535] and ``OSError`` when the address cannot be
    bound (``EADDRINUSE`` when another process holds it; ``filename`` is ``host:port``)."""

    def __init__(self, host: str, port: int) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port {port} is out of range (0 to 65535; 0 lets the OS choose)")
        try:
            self._server = _ExclusiveHTTPServer((host, port), _Handler)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror if exc.errno != errno.EADDRINUSE else "in use by another process", f"{host}:{port}") from None
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)

    def start(self, metrics: NodeMetrics) -> MetricsServer:
        """Serve ``metrics`` on the bound address."""
        self._server.metrics = metrics
        self._thread.start()
        log.info("metrics on http://%s/metrics", self.address)
        return self

    def stop(self) -> None:
        """Stop serving and release the port."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
