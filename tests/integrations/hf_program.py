"""Run by ``test_huggingface.py`` under ``torchrun --nproc-per-node 2``: ``NetoptimTrainer`` trains
:class:`~tests.integrations.common.Regression` in three runs, one job after another on one optimizer
node, and every rank saves what it trained on, its local gradients, its final parameters and
Trainer's logs.

- ``plain``: ``STEPS`` steps, linear warmup and decay, no clipping;
- ``clip``: the same with ``max_grad_norm=CLIP`` (the nodes clip);
- ``resume``: ``plain``'s configuration (in buckets of another size, so the node takes it as a job of
  its own), a checkpoint at step ``SAVED_AT``, stopped one step later (the node then holds a step the
  checkpoint does not have); then a new trainer and a new model resume from that checkpoint to ``STEPS``.

A fourth run, ``accelerate``, is a script's own loop with ``NetoptimAccelerator`` and a ``RemoteAdamW``
(``plain``'s schedule, its clipping threshold set so loose that it never clips).

Each run ends with a barrier: every rank has closed its optimizer, so the node has let the job
finish before the next one says HELLO.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers

from gpu_worker import RemoteAdamW
from netoptim.integrations.hf_accelerate import NetoptimAccelerator
from netoptim.integrations.huggingface import NetoptimTrainer
from netoptim.integrations.remote import parameter_names
from tests.integrations.common import CLIP, LOOSE, LR, PER_RANK, SAVED_AT, STEPS, WARMUP, WEIGHT_DECAY, Regression, decay_groups, samples, warmup_then_linear


class Pairs(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x, self.y = samples()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": self.y[index]}


class Recorder(transformers.TrainerCallback):
    """Each step's local gradients, as the optimizer is about to get them; stops at ``stop_at``."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.stop_at = stop_at

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None, **kwargs: Any) -> None:
        assert model is not None
        self.grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.stop_at is not None and state.global_step == self.stop_at:
            control.should_training_stop = True


def arguments(out: Path, *, max_grad_norm: float, save_steps: int | None = None) -> Any:
    return transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=PER_RANK,
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        lr_scheduler_type="linear",
        warmup_steps=WARMUP,
        max_grad_norm=max_grad_norm,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        use_cpu=True,
    )


def train(
    node: str, out: Path, *, bucket_numel: int, max_grad_norm: float = 0.0, save_steps: int | None = None, stop_at: int | None = None, resume: str | None = None
) -> dict:
    model = Regression()
    recorder = Recorder(stop_at)
    trainer = NetoptimTrainer(
        model=model,
        args=arguments(out, max_grad_norm=max_grad_norm, save_steps=save_steps),
        train_dataset=Pairs(),
        callbacks=[recorder],
        nodes=[node],
        optimizer_options={"timeout_s": 60, "bucket_numel": bucket_numel},
    )
    trainer.train(resume_from_checkpoint=resume)
    assert trainer.optimizer is None, "train() closes the optimizer it made"
    dist.barrier()
    return {
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
        "inputs": model.seen,
        "grads": recorder.grads,
        "logs": trainer.state.log_history,
        "wrapped": type(trainer.model_wrapped).__name__,
        "accelerator": type(trainer.accelerator).__name__,
    }


def train_accelerate(node: str, *, bucket_numel: int) -> dict:
    """The accelerate route: a loop of the script's own, the model prepared without DDP."""
    accelerator = NetoptimAccelerator(cpu=True, step_scheduler_with_optimizer=False)
    model = Regression()
    names = parameter_names(model)
    groups = [{**group, "params": [(names[id(p)], p) for p in group["params"]]} for group in decay_groups(model)]
    optimizer = RemoteAdamW(groups, lr=LR, nodes=[node], max_grad_norm=LOOSE, bucket_numel=bucket_numel, timeout_s=60)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_linear)
    loader = torch.utils.data.DataLoader(Pairs(), batch_size=PER_RANK, shuffle=True)
    prepared, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    grads = []
    for _, batch in zip(range(STEPS), loader, strict=False):
        accelerator.backward(prepared(**batch)["loss"])
        assert accelerator.clip_grad_norm_(prepared.parameters(), LOOSE) is None, "the nodes clip"
        grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    try:
        accelerator.clip_grad_norm_(prepared.parameters(), 1.0)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    accelerator.netoptim_optimizers()[0].close()
    dist.barrier()
    return {
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
        "inputs": model.seen,
        "grads": grads,
        "wrapped": type(prepared).__name__,
        "refused": refused,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    checkpoint = str(args.out / "resume" / f"checkpoint-{SAVED_AT}")
    results = {
        "plain": train(args.address, args.out / "plain", bucket_numel=300),
        "clip": train(args.address, args.out / "clip", bucket_numel=300, max_grad_norm=CLIP),
        "interrupted": train(args.address, args.out / "resume", bucket_numel=256, save_steps=SAVED_AT, stop_at=SAVED_AT + 1),
        "resumed": train(args.address, args.out / "resume", bucket_numel=256, save_steps=SAVED_AT, resume=checkpoint),
        "accelerate": train_accelerate(args.address, bucket_numel=200),
    }
    torch.save(results, args.out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
