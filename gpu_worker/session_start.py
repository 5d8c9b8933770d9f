"""A remote optimizer's session with its nodes, opened and connected: the connections (CURVE, the
same-host socket), a joining worker's step, the pacing of its pushes, and in layer-wise mode the
streamer that fetches its units. The options were checked against each other first
(:func:`gpu_worker.job_setup.check_options`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gpu_worker.exchange.push_pacing import PushPacer
from gpu_worker.layerwise.streaming import LayerStreamer
from gpu_worker.layerwise.units import UnitPlan
from gpu_worker.links.liveness import WorkerTimeouts
from gpu_worker.session import OffloadSession
from protos.job.hyper import AdamWHyper
from protos.job.spec import JobSpec
from transport.wire import MsgType
from transport.zeromq.security import CurveClientConfig


def start_session(
    nodes: Sequence[str],
    job: JobSpec,
    rank: int,
    params: Sequence[torch.Tensor],
    *,
    timeouts: WorkerTimeouts,
    curve_secret_key: str | None,
    curve_server_key: str | None,
    same_host_ipc: bool,
    connections_per_node: int,
    keep_step_gradients: bool,
    join_at_step: int | None,
    pace_window_bytes: int | None,
    units: UnitPlan | None,
    push_window_bytes: int,
    hypers: Callable[[], list[AdamWHyper]],
    sync_enabled: Callable[[], bool],
) -> tuple[OffloadSession, LayerStreamer | None]:
    """The session of rank ``rank`` over ``job`` (``params`` in its layout's order), connected: full
    mode registers or checks the layout and pulls the current values; layer-wise mode (``units``)
    connects a :class:`LayerStreamer` (``hypers`` and ``sync_enabled`` are the optimizer's, read as
    it pushes), returned with it. A failure closes the connections the session opened."""
    curve = CurveClientConfig(curve_secret_key, curve_server_key) if curve_secret_key and curve_server_key else None
    pacer: PushPacer | None = None
    pacer_ack = MsgType.CONSUMED
    if units is not None:
        pacer = PushPacer(push_window_bytes)  # acknowledged by the nodes' CONSUMED
    elif pace_window_bytes is not None:
        pacer, pacer_ack = PushPacer(pace_window_bytes), MsgType.PARAMS  # acknowledged by the bucket's new values
    session = OffloadSession(
        nodes,
        job,
        rank,
        params,
        timeouts=timeouts,
        curve=curve,
        same_host=same_host_ipc,
        connections_per_node=connections_per_node,
        keep_step_gradients=keep_step_gradients,
        pacer=pacer,
        pacer_ack=pacer_ack,
    )
    streamer: LayerStreamer | None = None
    try:
        if join_at_step is not None:  # a worker joining a running job: the nodes take it, at the new width, from that step
            session.join_at(join_at_step)
        if units is None:
            session.connect()
        else:
            streamer = LayerStreamer(units, session.stream_links(), hypers=hypers, sync_enabled=sync_enabled)
            streamer.connect()
    except BaseException:
        session.close()
        raise
    return session, streamer
