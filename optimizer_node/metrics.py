"""Prometheus metrics of a node, served as text on ``/metrics`` (``--metrics-port``).

The daemon thread records; the HTTP thread renders. A lock keeps each scrape consistent.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from optimizer_node.control import StepTimings
from optimizer_node.non_finite import NonFiniteStats

log = logging.getLogger(__name__)

UPDATE_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds from a bucket's first gradient of a step to its update being sent back."""


class NodeMetrics:
    """Counters, gauges and one histogram of a node."""

    def __init__(self, workers_connected: Callable[[], int], non_finite: NonFiniteStats | None = None) -> None:
        self._lock = threading.Lock()
        self._workers_connected = workers_connected
        self._non_finite = non_finite if non_finite is not None else NonFiniteStats("refuse")
        self.bytes_in = 0
        self.bytes_out = 0
        self.steps = 0
        self.rejected = 0
        self.last_step = StepTimings()
        self.step_seconds_total = StepTimings()
        self._latency_counts = [0] * (len(UPDATE_LATENCY_BUCKETS) + 1)
        self._latency_sum = 0.0

    def received(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_in += nbytes

    def sent(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_out += nbytes

    def rejected_message(self) -> None:
        with self._lock:
            self.rejected += 1

    def bucket_updated(self, latency_s: float) -> None:
        index = next((i for i, bound in enumerate(UPDATE_LATENCY_BUCKETS) if latency_s <= bound), len(UPDATE_LATENCY_BUCKETS))
        with self._lock:
            self._latency_counts[index] += 1
            self._latency_sum += latency_s

    def step_completed(self, timings: StepTimings) -> None:
        with self._lock:
            self.steps += 1
            self.last_step = timings
            total = self.step_seconds_total
            total.wall_s += timings.wall_s
            total.reduce_s += timings.reduce_s
            total.update_s += timings.update_s
            total.send_s += timings.send_s

    def render(self) -> str:
        """The Prometheus text exposition format."""
        with self._lock:
            lines = [
                "# HELP netoptim_bytes_received_total Tensor payload bytes received from workers.",
                "# TYPE netoptim_bytes_received_total counter",
                f"netoptim_bytes_received_total {self.bytes_in}",
                "# HELP netoptim_bytes_sent_total Tensor payload bytes sent to workers.",
                "# TYPE netoptim_bytes_sent_total counter",
                f"netoptim_bytes_sent_total {self.bytes_out}",
                "# HELP netoptim_steps_total Steps completed (every owned bucket updated).",
                "# TYPE netoptim_steps_total counter",
                f"netoptim_steps_total {self.steps}",
                "# HELP netoptim_rejected_messages_total Messages answered with an error.",
                "# TYPE netoptim_rejected_messages_total counter",
                f"netoptim_rejected_messages_total {self.rejected}",
                "# HELP netoptim_workers_connected Worker ranks that said HELLO.",
                "# TYPE netoptim_workers_connected gauge",
                f"netoptim_workers_connected {self._workers_connected()}",
                "# HELP netoptim_last_step_seconds Time of the last step, by part.",
                "# TYPE netoptim_last_step_seconds gauge",
            ]
            parts = ("wall", "reduce", "update", "send")
            lines += [f'netoptim_last_step_seconds{{part="{part}"}} {getattr(self.last_step, part + "_s"):.6f}' for part in parts]
            lines += ["# HELP netoptim_step_seconds_total Time spent in steps, by part.", "# TYPE netoptim_step_seconds_total counter"]
            lines += [f'netoptim_step_seconds_total{{part="{part}"}} {getattr(self.step_seconds_total, part + "_s"):.6f}' for part in parts]
            lines += [
                "# HELP netoptim_bucket_update_latency_seconds From a bucket's first gradient of a step to its new values leaving.",
                "# TYPE netoptim_bucket_update_latency_seconds histogram",
            ]
            cumulative = 0
            for bound, count in zip((*UPDATE_LATENCY_BUCKETS, float("inf")), self._latency_counts, strict=True):
                cumulative += count
                label = "+Inf" if bound == float("inf") else repr(bound)
                lines.append(f'netoptim_bucket_update_latency_seconds_bucket{{le="{label}"}} {cumulative}')
            lines += [f"netoptim_bucket_update_latency_seconds_sum {self._latency_sum:.6f}", f"netoptim_bucket_update_latency_seconds_count {cumulative}"]
        lines += self._non_finite_lines()
        return "\n".join(lines) + "\n"

    def _non_finite_lines(self) -> list[str]:
        """Gradients with NaN/inf: refused pushes, skipped steps, and the last event (-1: none, or not seen here)."""
        stats = self._non_finite.snapshot()
        last = stats["last"] or {"step": -1, "rank": -1, "bucket_id": -1}
        return [
            "# HELP netoptim_non_finite_policy The node's --non-finite policy (1 for the one in force).",
            "# TYPE netoptim_non_finite_policy gauge",
            *(f'netoptim_non_finite_policy{{policy="{policy}"}} {int(policy == stats["policy"])}' for policy in ("refuse", "skip")),
            "# HELP netoptim_non_finite_refused_total Pushes refused because the gradient held NaN or inf (--non-finite refuse).",
            "# TYPE netoptim_non_finite_refused_total counter",
            f"netoptim_non_finite_refused_total {stats['refused_pushes']}",
            "# HELP netoptim_non_finite_skipped_steps_total Steps skipped on every bucket because a gradient held NaN or inf (--non-finite skip).",
            "# TYPE netoptim_non_finite_skipped_steps_total counter",
            f"netoptim_non_finite_skipped_steps_total {stats['skipped_steps']}",
            "# HELP netoptim_non_finite_last_step Step of the last refused or skipped non-finite gradient (-1: none).",
            "# TYPE netoptim_non_finite_last_step gauge",
            f"netoptim_non_finite_last_step {last['step']}",
            "# HELP netoptim_non_finite_last_rank Rank whose gradient was the last non-finite one (-1: none, or seen by another node).",
            "# TYPE netoptim_non_finite_last_rank gauge",
            f"netoptim_non_finite_last_rank {last['rank']}",
            "# HELP netoptim_non_finite_last_bucket Bucket of the last non-finite gradient (-1: none, or seen by another node).",
            "# TYPE netoptim_non_finite_last_bucket gauge",
            f"netoptim_non_finite_last_bucket {last['bucket_id']}",
        ]


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
        body = metrics.render().encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
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
