"""Lightning with the optimizer on netoptim's nodes.

The one change to a Lightning script::

    from netoptim.integrations.lightning import NetoptimStrategy

    trainer = L.Trainer(accelerator="gpu", devices=8, strategy=NetoptimStrategy(nodes=["tcp://10.0.0.11:5555"]))  # was: strategy="ddp"
    trainer.fit(module)

launched as before (``torchrun``, Slurm, or Lightning starting the processes itself).
:class:`NetoptimStrategy` is Lightning's DDP strategy without the ``DistributedDataParallel`` wrapper:
the process group, distributed samplers, ``sync_dist`` logging, barriers and broadcasts are DDP's,
but no gradient is all-reduced. The optimizer the ``LightningModule`` configures (``torch.optim.AdamW``,
``Adam`` or ``SGD``) is replaced by its remote counterpart over the same parameters, param groups and
hyperparameters, and its learning-rate schedulers drive the replacement. ``Trainer(gradient_clip_val=...)``
becomes the nodes' global-norm clipping of the averaged gradient. Lightning's checkpoints hold the
optimizer state gathered from the nodes (torch's format), and ``fit(ckpt_path=...)`` loads it back onto them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch

from gpu_worker import RemoteOptimizer
from gpu_worker.discovery import NodeSource
from netoptim.integrations._extras import require
from netoptim.integrations.remote import parameter_names, rebind_schedulers, remote_optimizers, to_remote

require("lightning", by="netoptim.integrations.lightning")
strategies = require("lightning.pytorch.strategies", by="netoptim.integrations.lightning")
collective = require("lightning.fabric.plugins.collectives.torch_collective", by="netoptim.integrations.lightning")


def remote_clip_norm(trainer: Any) -> float | None:
    """The global norm the nodes clip to, from ``Trainer(gradient_clip_val=..., gradient_clip_algorithm=...)``;
    ``ValueError`` for clipping by value (the nodes clip by norm only)."""
    value = trainer.gradient_clip_val
    if not value:
        return None
    algorithm = trainer.gradient_clip_algorithm
    algorithm = str(getattr(algorithm, "value", algorithm) or "norm").lower()
    if algorithm != "norm":
        raise ValueError(
            f"NetoptimStrategy clips by the global norm of the averaged gradient, on the nodes: gradient_clip_algorithm={algorithm!r} is not supported"
        )
    return float(value)


class NetoptimStrategy(strategies.DDPStrategy):
    """DDP without the ``DistributedDataParallel`` wrapper, the optimizer on optimizer nodes.

    Args:
        nodes: the optimizer nodes (:mod:`gpu_worker.discovery`): a list of addresses, a host file's path, or
            ``None`` for ``$NETOPTIM_NODES`` / ``$NETOPTIM_NODE_FILE`` (read by rank 0, shared with the others).
        optimizer_options: more options of the remote optimizer (``wire_dtype``, ``bucket_numel``,
            ``timeout_s``, ``push_during_backward``, ``curve_secret_key``, ``broadcast_buffers``, ...).
            Clipping comes from ``Trainer(gradient_clip_val=...)``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, process_group_backend, timeout, start_method:
            as for Lightning's ``DDPStrategy``.

    A node serves one job at a time, so the module configures one optimizer (any number of param
    groups). A remote optimizer the module returns itself is used as it is.
    """

    strategy_name = "netoptim"

    def __init__(
        self,
        nodes: NodeSource = None,
        *,
        optimizer_options: Mapping[str, Any] | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = collective.default_pg_timeout,
        start_method: str = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
        )
        self.netoptim_nodes = nodes
        self.netoptim_options = dict(optimizer_options or {})
        if "max_grad_norm" in self.netoptim_options:
            raise ValueError("set Trainer(gradient_clip_val=...): the nodes clip to it")
        self._made: list[RemoteOptimizer] = []
        self._clip_norm: float | None = None

    def configure_ddp(self) -> None:
        """Leave the module unwrapped: the nodes average the gradients, nothing all-reduces them."""

    def setup_optimizers(self, trainer: Any) -> None:
        """The module's optimizers and schedulers, each optimizer replaced by its remote counterpart
        over the same param groups, the schedulers pointed at it."""
        super().setup_optimizers(trainer)
        self._clip_norm = remote_clip_norm(trainer)
        module = self.lightning_module
        assert module is not None
        local = [optimizer for optimizer in self.optimizers if not remote_optimizers([optimizer])]
        if len(self.optimizers) > 1 and local:
            raise ValueError(
                f"the module configures {len(self.optimizers)} optimizers: a node serves one job at a time, so NetoptimStrategy takes one "
                "(give it several param groups), or make each a gpu_worker remote optimizer on nodes of its own"
            )
        names = parameter_names(module)
        options = {"nodes": self.netoptim_nodes, "max_grad_norm": self._clip_norm, "module": module, **self.netoptim_options}
        replaced = []
        for optimizer in self.optimizers:
            if optimizer in local:
                remote = to_remote(optimizer, names, **options)
                rebind_schedulers([config.scheduler for config in self.lr_scheduler_configs], optimizer, remote)
                self._made.append(remote)
                optimizer = remote
            replaced.append(optimizer)
        self.optimizers = replaced

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step, without its local gradient clipping when the nodes clip (they clip the
        averaged gradient, as DDP's clipping after the all-reduce does)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or self._clip_norm is None or not remote_optimizers([optimizer]):
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        saved, trainer.gradient_clip_val = trainer.gradient_clip_val, None
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            trainer.gradient_clip_val = saved

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Gradient accumulation (``accumulate_grad_batches``): the backward passes before the last
        one do not push (the remote optimizers' ``no_sync``; it matters with ``push_during_backward``)."""
        with contextlib.ExitStack() as stack:
            for optimizer in remote_optimizers(self.optimizers):
                stack.enter_context(optimizer.no_sync())
            yield

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore the module's weights after the optimizers are made: making a remote optimizer
        installs the nodes' values, and loading its state dict then sends the checkpoint's parameters
        to the nodes as their masters, with the moments."""
        return True

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state for a checkpoint, gathered from the nodes on global rank 0 only
        (the rank that writes the file); the other ranks get an empty dict instead of reading it too."""
        if remote_optimizers([optimizer]) and not self.is_global_zero:
            return {}
        return super().optimizer_state(optimizer)

    def teardown(self) -> None:
        """Close the remote optimizers this strategy made (the nodes keep their state), then DDP's teardown."""
        for optimizer in self._made:
            optimizer.close()
        self._made = []
        super().teardown()
