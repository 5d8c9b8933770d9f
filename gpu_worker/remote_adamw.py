"""``RemoteAdamW``: a drop-in ``torch.optim.AdamW`` whose state lives on optimizer nodes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch

from gpu_worker.discovery import NodeSource
from gpu_worker.layerwise.units import UnitPlan
from gpu_worker.remote_optimizer import RemoteOptimizer, RemoteOptions
from protos.job.hyper import AdamWHyper

TORCH_ADAMW_GROUP_KEYS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": True,
    "decoupled_weight_decay": True,
}
"""What ``torch.optim.AdamW`` keeps in each param group besides the hyperparameters, as RemoteAdamW
computes it (the fused kernel); its state dicts carry them so torch resumes with the same math."""


class RemoteAdamW(RemoteOptimizer):
    """AdamW whose fp32 master parameters and moments live on optimizer nodes.

    Use it like ``torch.optim.AdamW``: ``loss.backward(); opt.step(); opt.zero_grad()``. ``step()``
    sends every gradient to the nodes, which average them over the job's ``world_size`` workers (as
    DDP does), apply AdamW once and send the new values back; they are copied into the parameters in
    place. No gradient all-reduce among workers is needed (do not also wrap the model in DDP).

    Args:
        params: parameters, ``named_parameters()``, or param groups (each may set its own ``lr``,
            ``betas``, ``eps``, ``weight_decay``). As with ``torch.optim.AdamW``, a parameter whose
            ``grad`` is None on every rank (frozen, or unused this step) is not stepped; one whose
            gradient is None on some ranks only counts as zeros from those (DDP's
            ``find_unused_parameters=True``). Frozen parameters are registered once, so they can be
            unfrozen later; leave out the ones that never train (they would take node memory).
        lr, betas, eps, weight_decay: as in ``torch.optim.AdamW``. The current values of each group
            travel with every step, so ``torch.optim.lr_scheduler`` works unchanged.
        amsgrad, maximize: as in ``torch.optim.AdamW``; only ``False`` (the nodes implement neither).
        nodes: where the job's optimizer nodes are (:mod:`gpu_worker.discovery`). A list of data-plane
            addresses, like ``["tcp://10.0.0.5:5555"]``, is used as given: every rank must list them
            in the same order. A host file's path (one address per line, ``#`` comments) or ``None``
            (the default: ``$NETOPTIM_NODES``, addresses separated by commas, else the host file
            ``$NETOPTIM_NODE_FILE``) is resolved by rank 0 alone, which publishes the list in the
            job's c10d store (``torch.distributed``'s, or ``torchrun``'s when no process group is
            initialized); the other ranks take rank 0's list from there, within ``timeout_s``.
        rank, world_size: this worker's rank and the number of data-parallel workers. Default:
            ``torch.distributed``'s when it is initialized, else ``RANK``/``WORLD_SIZE`` (as set by
            ``torchrun``), else 0 and 1.
        wire_dtype: dtype of gradients and parameters on the wire (float32, bfloat16 or float16); the
            master copy on the nodes is always fp32.
        max_grad_norm: clip the averaged gradient to this global L2 norm, with the semantics of
            ``torch.nn.utils.clip_grad_norm_``; ``last_grad_norm`` then holds the norm before clipping.
        bucket_numel: elements per transfer/update unit. Default: 4M (16 MiB of fp32), halved down to
            1M while a node would get fewer than 16 buckets (``default_bucket_numel``).
        bucket_layout: how parameters are cut into buckets: 1 fills each bucket, splitting a parameter
            where it fills; 2 never splits a parameter that fits in one bucket (a layer-wise CPU worker
            then computes on each as a view of the node's parameter board). Default: 2 layer-wise, 1
            for the full model. Every rank of a job gives the same; to resume a checkpoint of a job
            started before there were two, give 1.
        timeout_s: how long a wait for the nodes may go without progress (the nodes alive, the step
            not moving: a missing rank, a paused node) before a ``TimeoutError`` that names what is
            missing.
        connect_timeout_s: how long a node may take to answer the first HELLO (at most
            ``timeout_s``): a wrong or dead address fails after this, naming it.
        heartbeat_s, silent_after_s, reconnect_s: while waiting, a node silent for ``heartbeat_s``
            is pinged; one silent for ``silent_after_s`` is taken for gone and reconnected to for up
            to ``reconnect_s`` (a node restarted with ``--resume`` on the same address): the worker
            then continues at the node's step, pushing again what the node lost, or fails naming
            the node and what to do.
        push_during_backward: send each bucket as soon as backward has produced all its gradients,
            so the nodes update early buckets while backward still runs. Hyperparameters are then
            read when backward produces the gradients (change them before ``backward()``), and
            gradient accumulation over several backward passes must run inside :meth:`no_sync`,
            as with DDP. Pushes happen only from the thread that built the optimizer: where autograd
            runs the hooks on a thread of its own (its device thread, on a GPU), a bucket's copy out
            of the device starts there as its gradients are final, on a side stream that overlaps
            the rest of backward, and a courier thread sends it as soon as the copy has landed, while
            backward goes on (call ``backward()`` from the thread that built the optimizer: the
            courier uses the connections only while that thread is inside it); ``step()`` sends the
            rest.
        curve_secret_key, curve_server_key: for nodes that require CURVE (``netoptim node
            --curve-secret-key``): this worker's ``.key_secret`` file and the node's ``.key`` file.
        units: set by :func:`gpu_worker.offload` for layer-wise mode: the worker then holds only the
            units it computes, fetched just in time; ``step()`` pushes and returns without waiting.
        push_window_bytes: layer-wise mode: gradient bytes this worker may have pushed that the
            nodes have not used up yet; backward waits beyond it, so a slow node (out of core) is
            never flooded. Each node holds at most this much per worker of unconsumed gradients.
        pace_window_bytes: full-model mode with ``push_during_backward``: gradient bytes this worker
            may have pushed whose new values have not come back; a push beyond waits. Keeps the
            ranks' flows into a shared node link in step, so the node answers all through the
            step (docs/cluster.md); ``None`` (the default): no window. Not with ``max_grad_norm``
            (clipped values come back only once every gradient is in). A gradient the nodes refuse
            (``--non-finite refuse``) is reported from backward when a push waits for room.
        same_host_ipc: when a node runs on this host, move to the ipc:// socket it advertises at
            HELLO (a Unix socket: no TCP stack, no loopback retransmissions); ``False`` stays on
            the address given.
        connections_per_node: TCP connections to each node (ZeroMQ addresses), for links one TCP
            stream cannot fill: bucket ``b`` travels on connection ``b % connections_per_node``.
        module: the model the parameters belong to, for its buffers (BatchNorm statistics): with
            ``broadcast_buffers`` (the default, as DDP's), rank 0's buffers reach every rank at the
            start of each forward that follows a training forward, over ``torch.distributed``
            (initialize a process group; gloo is enough). Without ``module`` each rank keeps its own
            buffers. :func:`gpu_worker.offload` passes its model. See :mod:`gpu_worker.buffers`.
        broadcast_buffers: ``False`` leaves each rank's buffers its own (e.g. with SyncBatchNorm).
        overlap_forward: full-model mode, with ``module``: ``step()`` returns once the gradients are
            out, and the next forward of ``module`` waits for each submodule's new values as it
            reaches it, so the first layers compute while the nodes still update the last ones (the
            nodes update their buckets in the parameters' order). Read parameters outside that
            forward (an EMA, norms for a log) only after :meth:`synchronize`; ``state_dict()`` of the
            optimizer or the module, the end of the module's forward and the next ``step()`` call it.
            A step's gradients are held until its values are in (pushed again to a node that
            restarts meanwhile), through the next forward, unless ``keep_step_gradients=False``.
            See :mod:`gpu_worker.exchange.forward_waits`.
        keep_step_gradients: full-model mode: hold each step's gradients until its new values are in,
            so that a node that restarts in the middle of the step (``netoptim node --resume``) gets
            them pushed again and the job goes on (the default). ``False`` lets them go once the
            step's pushes are out: with ``overlap_forward`` the next forward's activations then do not
            come on top of them on the GPU (on a 1.0B GPT, about a gradient's size of GPU memory
            less), and a node that restarts mid-step stops this worker with a ``RuntimeError`` that
            says to restart it (it redoes the step), as a layer-wise worker, which keeps none, does.
        moments: how the nodes store the optimizer's moments: ``"fp32"`` (torch's, the default),
            ``"bf16"`` (half the bytes) or ``"8bit"`` (blockwise with an absmax scale per block and
            the dynamic map of 8-bit Adam: a quarter). The fp32 master parameters stay exact; tensors
            under 4,096 elements stay fp32. See docs/node.md for when to choose which.
        moment_block: ``"8bit"``: elements per scale (64 to 4096, a power of two; 256 by default).
        node_bandwidths: each node's link bandwidth (any unit, one number per node, the same on every
            rank): a node gets a share of the buckets in proportion, so a slower link is not the
            step's bottleneck. Default: equal shares.
        local_size: the workers behind this rank whose gradients it pushes summed (set by
            :class:`~gpu_worker.hierarchical.HostGroupAdamW` for its leader); the nodes divide the sum
            by ``world_size x local_size``. Default 1.
        join_at_step: a worker joining a running job whose workers agreed to grow at that step
            (:meth:`gpu_worker.elastic.ElasticGroup.join` gives it, with ``rank`` and ``world_size``);
            see :meth:`morph` for the workers already in it.

    On construction, rank 0 registers the layout and its initial values with the nodes (unless they
    already hold state for this job, for example after a restart of the workers); every rank then
    pulls the nodes' current values, so all ranks start identical. ``remote_step`` is the step the
    nodes are at, for resuming the data at the right place.
    """

    rule = "adamw"
    torch_group_keys: ClassVar[dict[str, Any]] = TORCH_ADAMW_GROUP_KEYS

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        nodes: NodeSource = None,
        rank: int | None = None,
        world_size: int | None = None,
        wire_dtype: torch.dtype = torch.float32,
        max_grad_norm: float | None = None,
        bucket_numel: int | None = None,
        bucket_layout: int | None = None,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 30.0,
        heartbeat_s: float = 2.0,
        silent_after_s: float = 10.0,
        reconnect_s: float = 20.0,
        push_during_backward: bool = False,
        curve_secret_key: str | None = None,
        curve_server_key: str | None = None,
        units: UnitPlan | None = None,
        push_window_bytes: int = 1 << 30,
        pace_window_bytes: int | None = None,
        same_host_ipc: bool = True,
        connections_per_node: int = 1,
        module: torch.nn.Module | None = None,
        broadcast_buffers: bool = True,
        join_at_step: int | None = None,
        local_size: int = 1,
        node_bandwidths: Sequence[float] | None = None,
        overlap_forward: bool = False,
        keep_step_gradients: bool = True,
        moments: str = "fp32",
        moment_block: int = 256,
    ) -> None:
        if amsgrad or maximize:
            raise ValueError("RemoteAdamW does not support amsgrad or maximize")
        AdamWHyper(float(lr), betas[0], betas[1], eps, weight_decay).validate()
        options = RemoteOptions.from_arguments(locals())
        self._setup(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}, options)
