"""``transformers.Trainer`` with the optimizer on netoptim's nodes.

The one change to a Trainer script::

    from netoptim.integrations.huggingface import NetoptimTrainer

    trainer = NetoptimTrainer(model=model, args=args, train_dataset=data, nodes=["tcp://10.0.0.11:5555"])  # was: Trainer(...)
    trainer.train()

launched as before (``torchrun --nproc-per-node N script.py``). What :class:`NetoptimTrainer` does:

- its optimizer is :class:`~gpu_worker.RemoteAdamW` over Trainer's own param groups (no weight decay
  on biases and norms), with ``learning_rate``, ``adam_beta1``/``adam_beta2``, ``adam_epsilon`` and
  ``weight_decay`` from the ``TrainingArguments``; Trainer's scheduler drives its groups' ``lr``;
- the model is not wrapped in ``DistributedDataParallel`` (:func:`netoptim.integrations.hf_accelerate.without_gradient_sync`):
  each rank's gradient goes to the nodes, which sum the ranks' gradients and divide by their number once;
- ``max_grad_norm`` (Trainer's default is 1.0) becomes the nodes' global-norm clipping of the averaged
  gradient; the logged ``grad_norm`` is the norm the nodes computed;
- checkpoints go through Trainer's own files: ``optimizer.pt`` holds the state gathered from the
  nodes (torch's AdamW format), and ``train(resume_from_checkpoint=...)`` loads the checkpoint's
  parameters, moments and step counts back onto the nodes, whatever they held.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gpu_worker import RemoteAdamW, RemoteOptimizer
from gpu_worker.discovery import NodeSource
from netoptim.integrations._extras import require
from netoptim.integrations.hf_accelerate import check_no_sharding, without_gradient_sync
from netoptim.integrations.remote import remote_optimizers

transformers = require("transformers", by="netoptim.integrations.huggingface")
trainer_module = require("transformers.trainer", by="netoptim.integrations.huggingface")

log = logging.getLogger(__name__)

ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")
"""``TrainingArguments.optim`` values NetoptimTrainer runs on the nodes (both are torch's AdamW)."""


class NetoptimTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` that trains with :class:`~gpu_worker.RemoteAdamW` on optimizer nodes
    and without ``DistributedDataParallel``. Every argument of ``Trainer`` is accepted, plus:

    Args:
        nodes: the optimizer nodes (:mod:`gpu_worker.discovery`): a list of addresses, a host file's path, or
            ``None`` for ``$NETOPTIM_NODES`` / ``$NETOPTIM_NODE_FILE`` (read by rank 0, shared with the others).
        optimizer_options: more options of :class:`~gpu_worker.RemoteAdamW` (``wire_dtype``,
            ``bucket_numel``, ``timeout_s``, ``curve_secret_key``, ...). ``max_grad_norm`` comes from the
            ``TrainingArguments``.

    ``optimizers=(optimizer, scheduler)`` may pass a remote optimizer made by the script (any rule);
    a torch optimizer is refused, since nothing would average the ranks' gradients for it. The
    optimizer this trainer makes is closed when ``train()`` returns (the nodes then see the job
    finished); the next ``train()`` makes a new one, which continues on the nodes where this one stopped.
    """

    def __init__(self, *args: Any, nodes: NodeSource = None, optimizer_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.netoptim_nodes = nodes
        self.netoptim_options = dict(optimizer_options or {})
        if "max_grad_norm" in self.netoptim_options:
            raise ValueError("set max_grad_norm in the TrainingArguments: the nodes clip to it")
        self._made_optimizer = False
        self._checked_wrapping = False
        super().__init__(*args, **kwargs)
        if self.optimizer is not None and not remote_optimizers([self.optimizer]):
            raise TypeError(
                f"NetoptimTrainer got a {type(self.optimizer).__name__} in optimizers=: nothing averages the ranks' gradients for it "
                "without DistributedDataParallel. Leave it out (NetoptimTrainer makes a RemoteAdamW) or pass a gpu_worker remote optimizer"
            )
        if getattr(self, "optimizer_cls_and_kwargs", None) is not None:
            raise ValueError("NetoptimTrainer makes a RemoteAdamW: optimizer_cls_and_kwargs is not used with it")

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator, made to prepare the model without ``DistributedDataParallel``."""
        super().create_accelerator_and_postprocess()
        check_no_sharding(self.accelerator)
        without_gradient_sync(self.accelerator)

    def netoptim_optimizer(self) -> RemoteOptimizer | None:
        """The remote optimizer under Trainer's wrappers, once it is made."""
        found = remote_optimizers([self.optimizer]) if self.optimizer is not None else []
        return found[0] if found else None

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """A :class:`~gpu_worker.RemoteAdamW` over Trainer's two param groups (decay and no decay),
        every parameter under its name, with the ``TrainingArguments``' hyperparameters and clipping."""
        if self.optimizer is not None:
            return self.optimizer
        args = self.args
        optim = getattr(args.optim, "value", args.optim)
        if optim not in ADAMW_OPTIMS:
            raise ValueError(
                f"NetoptimTrainer runs AdamW on the nodes: optim={optim!r} is not one of {', '.join(ADAMW_OPTIMS)}; "
                "for another rule pass optimizers=(RemoteSGD(...) / RemoteLion(...), None)"
            )
        opt_model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(opt_model))
        trainable = [(name, p) for name, p in opt_model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [(n, p) for n, p in trainable if n in decay], "weight_decay": args.weight_decay},
            {"params": [(n, p) for n, p in trainable if n not in decay], "weight_decay": 0.0},
        ]
        options: dict[str, Any] = {
            "nodes": self.netoptim_nodes,
            "max_grad_norm": args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None,
            "module": opt_model,
            "broadcast_buffers": True if args.ddp_broadcast_buffers is None else bool(args.ddp_broadcast_buffers),
            **self.netoptim_options,
        }
        self.optimizer = RemoteAdamW(
            [group for group in groups if group["params"]],
            lr=args.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
            weight_decay=args.weight_decay,
            **options,
        )
        self._made_optimizer = True
        return self.optimizer

    def training_step(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        """Trainer's step; the first one checks that nothing wrapped the model for gradient all-reduce."""
        if not self._checked_wrapping:
            if isinstance(model, nn.parallel.DistributedDataParallel):
                raise RuntimeError("the model was wrapped in DistributedDataParallel: its all-reduce would average the gradients before the nodes do")
            self._checked_wrapping = True
        return super().training_step(model, inputs, *args, **kwargs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer's log, with ``grad_norm`` from the nodes (the global norm of the averaged gradient)
        when they clip."""
        remote = self.netoptim_optimizer()
        if "loss" in logs and "grad_norm" not in logs and remote is not None and remote.last_grad_norm is not None:
            logs = {**logs, "grad_norm": remote.last_grad_norm}
        super().log(logs, *args, **kwargs)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Trainer's resume, with the checkpoint's parameters reloaded first: the remote optimizer, made
        since they were loaded, took the nodes' values, and ``load_state_dict`` makes the model's
        parameters the nodes' fp32 masters along with the checkpoint's moments and step counts."""
        remote = self.netoptim_optimizer()
        has_optimizer = checkpoint is not None and any(
            os.path.isfile(os.path.join(checkpoint, name)) for name in (trainer_module.OPTIMIZER_NAME, trainer_module.OPTIMIZER_NAME_BIN)
        )
        if remote is not None and has_optimizer:
            if remote.remote_step != self.state.global_step:
                log.info(
                    "resuming from %s at step %d; the nodes were at step %d: the checkpoint's state replaces theirs",
                    checkpoint,
                    self.state.global_step,
                    remote.remote_step,
                )
            self._load_from_checkpoint(checkpoint)
        super()._load_optimizer_and_scheduler(checkpoint)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's ``train``; then the optimizer this trainer made is closed (the nodes keep its state)."""
        output = super().train(*args, **kwargs)
        self.close_optimizer()
        return output

    def close_optimizer(self) -> None:
        """Close the remote optimizer this trainer made (its connections to the nodes); the next
        ``train()`` makes another."""
        remote = self.netoptim_optimizer()
        if remote is not None and self._made_optimizer:
            remote.close()
            self.optimizer = None
            self._made_optimizer = False


__all__ = ["ADAMW_OPTIMS", "NetoptimTrainer"]
