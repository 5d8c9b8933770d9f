"""``NetoptimTrainer`` under real ``torchrun`` (2 ranks, gloo) against a real optimizer node: the
parameters after training are what ``torch.optim.AdamW(fused=True)`` in one process gives when fed
the average of the two ranks' gradients, and a run resumed from Trainer's checkpoint ends where an
uninterrupted one does. fp32 on the wire: bitwise."""

from __future__ import annotations

import pytest
import torch

from tests.integrations.common import (
    CLIP,
    LOOSE,
    LR,
    SAVED_AT,
    STEPS,
    WARMUP,
    WORLD_SIZE,
    Regression,
    assert_bitwise,
    averaged_reference,
    decay_groups,
    max_difference,
    ranks_of_a_run,
    warmup_then_linear,
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Every run of :mod:`tests.integrations.hf_program`, as each rank saved it."""
    return ranks_of_a_run(tmp_path_factory.mktemp("hf"), "hf_program")


def trainer_oracle(run: list[dict], *, max_grad_norm: float | None = None) -> tuple[dict, list, list[float]]:
    """torch's fused AdamW over Trainer's param groups (decay on the Linear weights only), Trainer's
    linear schedule, fed the average of the batches each rank trained on."""
    from transformers import get_linear_schedule_with_warmup

    def make(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, object]:
        optimizer = torch.optim.AdamW(decay_groups(model), lr=LR, fused=True)
        return optimizer, get_linear_schedule_with_warmup(optimizer, WARMUP, STEPS)

    batches = [[rank["inputs"][step] for rank in run] for step in range(STEPS)]
    return averaged_reference(Regression(), batches, make, max_grad_norm=max_grad_norm)


def test_trainer_matches_adamw_fed_the_averaged_gradients_without_all_reduce(ranks):
    """(a) Two ranks, ``STEPS`` steps, linear warmup and decay: every parameter bitwise equal to the
    oracle on both ranks. The model was never wrapped in DistributedDataParallel, and each rank's
    gradient at every step is exactly the gradient of its own batch (no all-reduce touched it)."""
    plain = [rank["plain"] for rank in ranks]
    expected, local, _ = trainer_oracle(plain)
    for rank, run in enumerate(plain):
        assert run["wrapped"] == "Regression", f"rank {rank}: Trainer wrapped the model in {run['wrapped']}"
        assert run["accelerator"] == "NetoptimAccelerator"
        assert len(run["grads"]) == STEPS
        for step, grads in enumerate(run["grads"]):
            assert_bitwise(local[step][rank], grads, f"rank {rank}'s local gradient at step {step}")
        assert_bitwise(expected, run["params"], f"rank {rank}'s parameters after {STEPS} steps")
    assert not torch.equal(plain[0]["grads"][0]["net.0.weight"], plain[1]["grads"][0]["net.0.weight"]), "the ranks trained on different batches"
    learning_rates = [entry["learning_rate"] for entry in plain[0]["logs"] if "loss" in entry]
    assert learning_rates == pytest.approx([0.0, 0.005, 0.01, 0.0075, 0.005, 0.0025]), "Trainer's schedule drove the remote optimizer"


def test_max_grad_norm_is_the_nodes_global_norm_clipping(ranks):
    """``max_grad_norm`` is clipped on the nodes, on the averaged gradient (not each rank's own): the
    logged ``grad_norm`` is the global norm of the average, and the parameters follow torch's
    ``clip_grad_norm_`` on it. Not bitwise by design: the nodes add the norm's squares in fp64 and in
    another order (docs/architecture.md, *Numerics*), so the clip factor may differ in its last bit."""
    clip = [rank["clip"] for rank in ranks]
    expected, local, norms = trainer_oracle(clip, max_grad_norm=CLIP)
    logged = [entry["grad_norm"] for entry in clip[0]["logs"] if "loss" in entry]
    assert logged == pytest.approx(norms, rel=1e-6)
    assert min(norms) > CLIP, "every step was clipped"
    for rank, run in enumerate(clip):
        # The first step's parameters are the oracle's bit for bit (later ones within the clip factor's last bit):
        # Trainer left the local gradient as backward made it, its norm above CLIP.
        assert_bitwise(local[0][rank], run["grads"][0], f"rank {rank}'s first gradient, unclipped")
        assert float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in run["grads"][0].values()]))) > CLIP
        assert max_difference(expected, run["params"]) <= 1e-6
    assert_bitwise(clip[0]["params"], clip[1]["params"], "the ranks")


def test_resume_from_a_trainer_checkpoint_continues_bitwise(ranks):
    """(b) Trainer saves ``checkpoint-SAVED_AT`` (optimizer.pt gathered from the node), trains one more
    step and stops; a new trainer with a new model resumes from the checkpoint, although the node has
    moved past it, and ends bitwise where the uninterrupted run did, on the same batches."""
    for rank, run in enumerate(ranks):
        assert len(run["interrupted"]["inputs"]) == SAVED_AT + 1
        assert len(run["resumed"]["inputs"]) == STEPS - SAVED_AT
        for step, (x, y) in enumerate(run["resumed"]["inputs"], start=SAVED_AT):
            assert torch.equal(x, run["plain"]["inputs"][step][0]) and torch.equal(y, run["plain"]["inputs"][step][1]), f"rank {rank}: step {step}'s batch"
        assert_bitwise(run["plain"]["params"], run["resumed"]["params"], f"rank {rank}: resumed against uninterrupted")
    saved = torch.load(ranks[0]["root"] / "resume" / f"checkpoint-{SAVED_AT}" / "optimizer.pt", weights_only=True)
    assert saved["netoptim"]["step"] == SAVED_AT and saved["netoptim"]["world_size"] == WORLD_SIZE
    assert sorted(saved["state"]) == list(range(len(ranks[0]["plain"]["params"])))
    assert all(float(entry["step"]) == SAVED_AT for entry in saved["state"].values()), "the moments of step SAVED_AT, in torch's AdamW format"


def test_accelerate_loop_with_netoptim_accelerator_matches_the_oracle(ranks):
    """A script's own accelerate loop: ``NetoptimAccelerator`` prepares model, ``RemoteAdamW``, data and
    scheduler; the model stays unwrapped, the gradients local, and the parameters bitwise the oracle's.
    ``accelerator.clip_grad_norm_`` leaves clipping to the nodes, and refuses a threshold other than
    the optimizer's ``max_grad_norm``."""
    run = [rank["accelerate"] for rank in ranks]

    def make(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, object]:
        optimizer = torch.optim.AdamW(decay_groups(model), lr=LR, fused=True)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_linear)

    batches = [[rank["inputs"][step] for rank in run] for step in range(STEPS)]
    expected, local, _ = averaged_reference(Regression(), batches, make, max_grad_norm=LOOSE)
    for rank, result in enumerate(run):
        assert result["wrapped"] == "Regression"
        for step, grads in enumerate(result["grads"]):
            assert_bitwise(local[step][rank], grads, f"rank {rank}'s local gradient at step {step}")
        assert_bitwise(expected, result["params"], f"rank {rank}'s parameters")
        assert "make the RemoteAdamW with max_grad_norm=1.0" in result["refused"]
