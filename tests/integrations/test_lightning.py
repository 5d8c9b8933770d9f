"""``Trainer(strategy=NetoptimStrategy(...))`` under real ``torchrun`` (2 ranks, gloo) against a real
optimizer node, for a ``LightningModule`` that configures ``torch.optim.AdamW`` and a scheduler: the
parameters are what ``torch.optim.AdamW(fused=True)`` in one process gives when fed the average of
the two ranks' gradients, and a run resumed from a Lightning checkpoint ends where an uninterrupted
one does. fp32 on the wire: bitwise."""

from __future__ import annotations

import pytest
import torch

from tests.integrations.common import (
    CLIP,
    LR,
    SAVED_AT,
    STEPS,
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
    """Every run of :mod:`tests.integrations.lightning_program`, as each rank saved it."""
    return ranks_of_a_run(tmp_path_factory.mktemp("lightning"), "lightning_program")


def module_oracle(run: list[dict], *, max_grad_norm: float | None = None) -> tuple[dict, list, list[float]]:
    """What the module configures (AdamW over its two param groups, a per-step LambdaLR) as torch's
    fused AdamW in one process, fed the average of the batches each rank trained on. Parameter names
    are the module's (``net.*``), as in :class:`~tests.integrations.common.Regression`."""

    def make(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, object]:
        optimizer = torch.optim.AdamW(decay_groups(model), lr=LR, fused=True)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_linear)

    batches = [[rank["inputs"][step] for rank in run] for step in range(STEPS)]
    return averaged_reference(Regression(), batches, make, max_grad_norm=max_grad_norm)


def test_strategy_matches_adamw_fed_the_averaged_gradients_without_all_reduce(ranks):
    """(c) Two ranks, ``STEPS`` steps over two shuffled epochs: the module's AdamW became a RemoteAdamW,
    the module was not wrapped in DistributedDataParallel, each rank's gradient at every step is exactly
    its own batch's, and every parameter is bitwise equal to the oracle's on both ranks."""
    plain = [rank["plain"] for rank in ranks]
    expected, local, _ = module_oracle(plain)
    for rank, run in enumerate(plain):
        assert run["wrapped"] == "RegressionModule", f"rank {rank}: the strategy wrapped the module in {run['wrapped']}"
        assert run["optimizer"] == "RemoteAdamW"
        assert len(run["grads"]) == STEPS
        for step, grads in enumerate(run["grads"]):
            assert_bitwise(local[step][rank], grads, f"rank {rank}'s local gradient at step {step}")
        assert_bitwise(expected, run["params"], f"rank {rank}'s parameters after {STEPS} steps")
    assert not torch.equal(plain[0]["grads"][0]["net.0.weight"], plain[1]["grads"][0]["net.0.weight"]), "the ranks trained on different batches"


def test_gradient_clip_val_is_the_nodes_global_norm_clipping(ranks):
    """``Trainer(gradient_clip_val=CLIP)`` clips on the nodes, the averaged gradient by its global norm
    (Lightning clips nothing locally: each rank's gradients clipped to CLIP before averaging would end
    far from the oracle): the nodes' norms are the oracle's, the parameters within 1e-6 of it, and the
    Trainer's setting is left as the script gave it. Not bitwise by design: the nodes add the norm's
    squares in fp64 and in another order (docs/architecture.md, *Numerics*)."""
    clip = [rank["clip"] for rank in ranks]
    expected, _, norms = module_oracle(clip, max_grad_norm=CLIP)
    assert min(norms) > CLIP, "every step was clipped"
    for run in clip:
        assert run["norms"] == pytest.approx(norms, rel=1e-6)
        assert max_difference(expected, run["params"]) <= 1e-6
        assert run["gradient_clip_val"] == CLIP
    assert_bitwise(clip[0]["params"], clip[1]["params"], "the ranks")


def test_resume_from_a_lightning_checkpoint_continues_bitwise(ranks):
    """(d) ``trainer.save_checkpoint`` after step ``SAVED_AT`` (the optimizer state gathered from the
    node, on rank 0), one more step, a stop; a new trainer and module ``fit(ckpt_path=...)`` although
    the node has moved past the checkpoint, and end bitwise where the uninterrupted run did."""
    for rank, run in enumerate(ranks):
        assert len(run["interrupted"]["inputs"]) == SAVED_AT + 1
        assert len(run["resumed"]["inputs"]) == STEPS - SAVED_AT
        for step, (x, _) in enumerate(run["resumed"]["inputs"], start=SAVED_AT):
            assert torch.equal(x, run["plain"]["inputs"][step][0]), f"rank {rank}: step {step}'s batch"
        assert_bitwise(run["plain"]["params"], run["resumed"]["params"], f"rank {rank}: resumed against uninterrupted")
    saved = torch.load(ranks[0]["root"] / "saved.ckpt", weights_only=False)["optimizer_states"][0]
    assert saved["netoptim"]["step"] == SAVED_AT
    assert sorted(saved["state"]) == list(range(len(ranks[0]["plain"]["params"])))
    assert all(float(entry["step"]) == SAVED_AT for entry in saved["state"].values()), "the moments of step SAVED_AT, in torch's AdamW format"
