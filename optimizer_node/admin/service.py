"""The node's admin plane: the ``OptimizerNodeAdmin`` gRPC service, the standard health service and
server reflection, optionally behind a bearer token.

RPC handlers run on gRPC's threads and never touch the node's state: they reach the node through its
:class:`~optimizer_node.daemon.AdminHandle`, whose ``call`` submits a function to the node's
:class:`~optimizer_node.control.CommandQueue`, which the node's thread runs between two messages.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from importlib import metadata
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from optimizer_node.admin.address import bind_error, split_host_port
from optimizer_node.admin.guards import BearerTokenInterceptor, RequestDecodingInterceptor
from optimizer_node.control import StepTimings
from optimizer_node.daemon import AdminHandle
from optimizer_node.state.checkpoint import CheckpointError
from optimizer_node.update.adamw import HyperOverrides
from protos import admin_pb2, admin_pb2_grpc
from transport.host_threads import name_os_thread

log = logging.getLogger(__name__)

T = TypeVar("T")
SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["OptimizerNodeAdmin"].full_name
_OVERRIDE_FIELDS = ("lr", "lr_scale", "beta1", "beta2", "eps", "weight_decay")

DEFAULT_WAIT_S = 300.0
"""How long Checkpoint and Drain wait for the step in flight when the request says 0."""

MAX_WAIT_S = 24 * 3600.0
"""The longest timeout_seconds a Checkpoint or Drain may ask for."""

MAX_REASON_CHARS = 1000
"""A pause reason goes to every worker and into logs: one line of printable text at most this long."""

ADMIN_THREADS = 8
"""Threads serving admin calls."""

MAX_LONG_CALLS = ADMIN_THREADS // 2
"""Calls that hold a thread while they wait (WatchSteps streams, Checkpoint and Drain waiting for the
step in flight) at most at once: the other threads stay free for status calls and health checks."""


def _version() -> str:
    try:  # the distribution's, so that a node reads no module above it (netoptim.__version__ is the same number)
        return metadata.version("netoptim-train")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


@dataclass(kw_only=True, slots=True)
class AdminConfig:
    """Settings of a node's admin service."""

    address: str = "127.0.0.1:0"
    """HOST:PORT to serve on; port 0 lets the OS choose. Loopback unless told otherwise."""

    token: str | None = None
    """When set, every call but health checks needs the metadata ``authorization: Bearer TOKEN``."""

    tls_cert: str | None = None
    """PEM certificate file; with tls_key, the service speaks TLS only."""

    tls_key: str | None = None
    """PEM private key file of tls_cert."""

    call_timeout_s: float = 10.0
    """How long a call waits for the daemon thread before answering UNAVAILABLE."""


def _timings(timings: StepTimings) -> admin_pb2.StepTimings:
    median, p90, longest = timings.pass_percentiles(0.5, 0.9, 1.0)
    return admin_pb2.StepTimings(
        wall_seconds=timings.wall_s,
        reduce_seconds=timings.reduce_s,
        update_seconds=timings.update_s,
        send_seconds=timings.send_s,
        pass_seconds=sum(timings.passes),
        pass_median_ms=1e3 * median,
        pass_p90_ms=1e3 * p90,
        pass_max_ms=1e3 * longest,
        buckets=len(timings.passes),
        tail_seconds=timings.tail_s,
    )


def _overrides_message(overrides: HyperOverrides, max_grad_norm: float | None) -> admin_pb2.Hyperparameters:
    values = {name: getattr(overrides, name) for name in _OVERRIDE_FIELDS if getattr(overrides, name) is not None}
    if max_grad_norm is not None:
        values["max_grad_norm"] = max_grad_norm
    return admin_pb2.Hyperparameters(**values)


def _non_finite(stats: dict) -> admin_pb2.NonFiniteStatus:
    """The node's non-finite gradient counters (:meth:`NonFiniteStats.snapshot`) as a message."""
    message = admin_pb2.NonFiniteStatus(policy=stats["policy"], refused_pushes=stats["refused_pushes"], skipped_steps=stats["skipped_steps"])
    last = stats["last"]
    if last is not None:
        message.last.CopyFrom(
            admin_pb2.NonFiniteEvent(
                action=last["action"], step=last["step"], rank=last["rank"], bucket=last["bucket_id"], values=last["values"], unix_time=last["unix_time"]
            )
        )
    return message


def _workers(last_seen: dict[int, float]) -> list[admin_pb2.WorkerInfo]:
    return [admin_pb2.WorkerInfo(rank=rank, last_seen_unix=seen) for rank, seen in last_seen.items()]


class AdminServicer(admin_pb2_grpc.OptimizerNodeAdminServicer):
    """Translates RPCs into calls on the node's thread."""

    def __init__(self, node: AdminHandle, config: AdminConfig) -> None:
        self._node = node
        self._config = config
        self._long_calls = threading.BoundedSemaphore(MAX_LONG_CALLS)

    @contextlib.contextmanager
    def _long_call(self, context: grpc.ServicerContext) -> Iterator[None]:
        """Hold one of the :data:`MAX_LONG_CALLS` slots for a call that waits; RESOURCE_EXHAUSTED when none is free."""
        if not self._long_calls.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{MAX_LONG_CALLS} calls that wait (WatchSteps, Checkpoint, Drain) are in progress, the most this node serves at once; try again when one has ended",
            )
        try:
            yield
        finally:
            self._long_calls.release()

    def _call(self, context: grpc.ServicerContext, function: Callable[[], T]) -> T:
        try:
            return self._node.call(function, self._config.call_timeout_s)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TimeoutError:
            context.abort(
                grpc.StatusCode.UNAVAILABLE, f"the node did not answer within {self._config.call_timeout_s:.0f} s (stopping, or busy in a long update)"
            )
        raise AssertionError("unreachable: abort raises")

    def GetStatus(self, request: admin_pb2.GetStatusRequest, context: grpc.ServicerContext) -> admin_pb2.GetStatusResponse:
        status = self._call(context, lambda: self._node.operator().status())
        return admin_pb2.GetStatusResponse(
            node_id=status["node_id"],
            version=_version(),
            uptime_seconds=status["uptime_s"],
            registered=status["registered"],
            step=status["step"],
            buckets_owned=status["buckets_owned"],
            bytes_owned=status["bytes_owned"],
            bytes_in_ram=status["bytes_in_ram"],
            bytes_on_disk=status["bytes_on_disk"],
            world_size=status["world_size"],
            workers=_workers(status["workers"]),
            last_step=_timings(status["last_step"]),
            paused=status["paused"] is not None,
            pause_reason=status["paused"] or "",
            data_address=status["data_address"],
            non_finite=_non_finite(status["non_finite"]),
            job_state=status["job_state"],
            drain_step=status["drain_step"],
            overrides=[admin_pb2.Override(**entry) for entry in status["overrides"]],
            jobs_let_go=status["jobs_let_go"],
            morphs=status["morphs"],
            last_morph_step=status["last_morph_step"],
            last_morph_from=status["last_morph_from"],
            last_morph_pause_seconds=status["last_morph_pause_s"],
            update_path=status["update_path"],
            state_at_risk=status["state_at_risk"],
            moments=status["moments"],
        )

    def ListWorkers(self, request: admin_pb2.ListWorkersRequest, context: grpc.ServicerContext) -> admin_pb2.ListWorkersResponse:
        status = self._call(context, lambda: self._node.operator().status())
        return admin_pb2.ListWorkersResponse(world_size=status["world_size"], workers=_workers(status["workers"]))

    def GetHyperparameters(self, request: admin_pb2.GetHyperparametersRequest, context: grpc.ServicerContext) -> admin_pb2.GetHyperparametersResponse:
        def read() -> tuple:
            operator = self._node.operator()
            return operator.hyper_overrides, operator.clip_override, operator.last_applied(), operator.override_list()

        overrides, clip, applied, origins = self._call(context, read)
        return admin_pb2.GetHyperparametersResponse(
            overrides=_overrides_message(overrides, clip),
            origins=[admin_pb2.Override(**entry) for entry in origins],
            last_applied=[
                admin_pb2.AppliedHyperparameters(group=group, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay)
                for group, h in sorted(applied.items())
            ],
        )

    def SetHyperparameters(self, request: admin_pb2.SetHyperparametersRequest, context: grpc.ServicerContext) -> admin_pb2.SetHyperparametersResponse:
        def change() -> tuple[HyperOverrides, float | None]:
            operator = self._node.operator()
            base = HyperOverrides() if request.clear else operator.hyper_overrides
            values = {name: getattr(base, name) for name in _OVERRIDE_FIELDS}
            for name in _OVERRIDE_FIELDS:
                if request.overrides.HasField(name):
                    values[name] = getattr(request.overrides, name)
            overrides = HyperOverrides(**values)
            overrides.validate()
            if overrides.lr is not None and overrides.lr_scale is not None and not math.isfinite(overrides.lr * overrides.lr_scale):
                raise ValueError(f"lr {overrides.lr} times lr_scale {overrides.lr_scale} is not a finite learning rate")
            clip_changes = request.overrides.HasField("max_grad_norm") or request.clear
            clip = request.overrides.max_grad_norm if request.overrides.HasField("max_grad_norm") else None
            if clip_changes:
                operator.check_max_grad_norm(clip)
            # Both validated: apply both, or neither.
            operator.set_overrides(overrides)
            if clip_changes:
                operator.set_max_grad_norm(clip)
            return operator.hyper_overrides, operator.clip_override

        return admin_pb2.SetHyperparametersResponse(overrides=_overrides_message(*self._call(context, change)))

    def Pause(self, request: admin_pb2.PauseRequest, context: grpc.ServicerContext) -> admin_pb2.PauseResponse:
        reason = request.reason
        # Every worker is told the reason and the node logs it: a line break or a control character
        # would let a caller forge log lines.
        if len(reason) > MAX_REASON_CHARS or not reason.isprintable():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the reason must be printable text on one line, at most {MAX_REASON_CHARS} characters")
        return admin_pb2.PauseResponse(step=self._call(context, lambda: self._node.operator().pause(reason)))

    def Resume(self, request: admin_pb2.ResumeRequest, context: grpc.ServicerContext) -> admin_pb2.ResumeResponse:
        applied, step = self._call(context, lambda: (self._node.operator().resume(), self._node.step()))
        return admin_pb2.ResumeResponse(step=step, buckets_applied=applied)

    def _await_checkpoint(self, context: grpc.ServicerContext, start: Callable[[], futures.Future], timeout_s: float) -> dict:
        # Checked before anything starts: a Drain refused here has not begun draining.
        if not (math.isfinite(timeout_s) and 0.0 <= timeout_s <= MAX_WAIT_S):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_seconds must be in [0, {MAX_WAIT_S:.0f}] (0: {DEFAULT_WAIT_S:.0f} s), got {timeout_s}")
        with self._long_call(context):
            pending = self._call(context, start)
            deadline = time.monotonic() + (timeout_s or DEFAULT_WAIT_S)
            while True:  # in slices: a caller that went away (cancelled, or past its own deadline) frees the thread
                try:
                    return pending.result(min(0.25, max(deadline - time.monotonic(), 0.0)))
                except (ValueError, CheckpointError) as exc:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
                except futures.TimeoutError:
                    if time.monotonic() >= deadline or not context.is_active():
                        context.abort(
                            grpc.StatusCode.DEADLINE_EXCEEDED, "the step in flight did not finish in time; the checkpoint will still be taken when it does"
                        )

    def Checkpoint(self, request: admin_pb2.CheckpointRequest, context: grpc.ServicerContext) -> admin_pb2.CheckpointResponse:
        manifest = self._await_checkpoint(context, self._node.request_checkpoint, request.timeout_seconds)
        return admin_pb2.CheckpointResponse(step=manifest["step"], path=manifest["path"], manifest_json=json.dumps(manifest))

    def Drain(self, request: admin_pb2.DrainRequest, context: grpc.ServicerContext) -> admin_pb2.DrainResponse:
        manifest = self._await_checkpoint(context, self._node.drain, request.timeout_seconds)
        return admin_pb2.DrainResponse(step=manifest["step"], path=manifest["path"], manifest_json=json.dumps(manifest))

    def Shutdown(self, request: admin_pb2.ShutdownRequest, context: grpc.ServicerContext) -> admin_pb2.ShutdownResponse:
        log.warning("shutdown requested through the admin service")
        self._call(context, self._node.request_stop)
        return admin_pb2.ShutdownResponse()

    def Reset(self, request: admin_pb2.ResetRequest, context: grpc.ServicerContext) -> admin_pb2.ResetResponse:
        node_id = self._node.node_id
        if request.confirm_node_id != node_id:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"a reset drops this node's job: confirm it with this node's id, {node_id!r} (netoptim admin reset asks for it); got {request.confirm_node_id!r}",
            )
        log.warning("reset requested through the admin service")
        dropped = self._call(context, lambda: self._node.let_job_go("an operator reset the node (netoptim admin reset)"))
        return admin_pb2.ResetResponse(job=dropped["job"], step=dropped["step"], archived=dropped["archived"])

    def Morph(self, request: admin_pb2.MorphRequest, context: grpc.ServicerContext) -> admin_pb2.MorphResponse:
        reason = request.reason
        if len(reason) > MAX_REASON_CHARS or not reason.isprintable():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the reason must be printable text on one line, at most {MAX_REASON_CHARS} characters")
        told, width = self._call(
            context, lambda: (self._node.operator().ask_to_leave(list(request.leave), reason), self._node.operator().status()["world_size"])
        )
        return admin_pb2.MorphResponse(told=told, world_size=width)

    def WatchSteps(self, request: admin_pb2.WatchStepsRequest, context: grpc.ServicerContext) -> Iterator[admin_pb2.StepEvent]:
        with self._long_call(context):
            events = self._node.clock.subscribe()
            context.add_callback(lambda: events.put(None))  # a cancelled call unblocks the loop
            context.send_initial_metadata(())  # the watcher knows it is subscribed before any step
            try:
                while (event := events.get()) is not None:
                    yield admin_pb2.StepEvent(step=event.step, unix_time=event.unix_time, timings=_timings(event.timings))
            finally:
                self._node.clock.unsubscribe(events)


class AdminServer:
    """The admin service of one node. Constructing it binds the address exclusively (no
    SO_REUSEPORT: a second node cannot share it), so a node learns that its address is taken before it
    loads anything; :meth:`start` then serves a node there. ``address`` is the bound HOST:PORT.

    Raises ``ValueError`` for a malformed address or TLS settings, and ``OSError`` (``EADDRINUSE``
    when another process holds the port, ``filename`` the address) when the address cannot be bound."""

    def __init__(self, config: AdminConfig) -> None:
        host, _port = split_host_port(config.address)
        if bool(config.tls_cert) != bool(config.tls_key):
            raise ValueError("TLS needs both a certificate and its key")
        # The token is checked first; its refusal, like every handler, reads the request leniently.
        interceptors = [*([BearerTokenInterceptor(config.token)] if config.token else []), RequestDecodingInterceptor()]
        executor = futures.ThreadPoolExecutor(max_workers=ADMIN_THREADS, thread_name_prefix="admin", initializer=name_os_thread)
        self._server = grpc.server(executor, interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server)
        self.address = f"{host}:{self._bind(config)}"
        self._config = config
        self._node: AdminHandle | None = None

    def _bind(self, config: AdminConfig) -> int:
        """Add the listening port; gRPC returns 0 on failure in some versions and raises in others."""
        credentials = None
        if config.tls_cert and config.tls_key:
            with open(config.tls_key, "rb") as key, open(config.tls_cert, "rb") as cert:
                credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
        try:
            if credentials is not None:
                port = self._server.add_secure_port(config.address, credentials)
            else:
                port = self._server.add_insecure_port(config.address)
        except RuntimeError as exc:
            raise bind_error(config.address, str(exc).partition(";")[0]) from None
        if port == 0:
            raise bind_error(config.address, "no port was added")
        return port

    def start(self, node: AdminHandle) -> AdminServer:
        """Serve ``node``'s admin calls on the bound address (:meth:`NodeDaemon.admin_handle`); the node's
        ready file names :attr:`address` once it is given it (``admin_address``)."""
        admin_pb2_grpc.add_OptimizerNodeAdminServicer_to_server(AdminServicer(node, self._config), self._server)
        self._server.start()
        for service in ("", SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._node = node
        log.info(
            "admin service on %s (%s, %s)",
            self.address,
            "token required" if self._config.token else "no token: bind it to a trusted interface only",
            "TLS" if self._config.tls_cert else "plaintext",
        )
        return self

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving (calls in flight get ``grace_s``) and release the address."""
        self._health.enter_graceful_shutdown()
        if self._node is not None:
            self._node.clock.close()
        self._server.stop(grace_s).wait(grace_s + 1)
