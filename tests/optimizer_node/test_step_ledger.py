"""The step ledger alone: where a rank resumes, and how long previous values are kept."""

from __future__ import annotations

import torch

from optimizer_node.intake.step_ledger import StepLedger


def test_resume_point_of_a_rank_killed_mid_push():
    steps = {0: 4, 1: 4, 2: 3, 3: 3}  # buckets 0, 1 updated (every rank pushed), 2, 3 wait
    held = {(2, 0), (3, 0), (3, 1)}  # rank 0 pushed 2 and 3, rank 1 only 3
    assert StepLedger.resume_point(1, steps, lambda b, r: (b, r) in held) == (3, [0, 1, 3])
    assert StepLedger.resume_point(0, steps, lambda b, r: (b, r) in held) == (4, [])  # rank 0 has all of step 3 in
    assert StepLedger.resume_point(1, {0: 4, 1: 4}, lambda b, r: False) == (4, [])  # between steps


def test_previous_values_are_kept_until_a_gradient_of_the_next_step():
    ledger = StepLedger()
    param = torch.arange(4, dtype=torch.float32)
    ledger.retain(0, 3, param, torch.float32)
    param.add_(1)  # the update
    assert torch.equal(ledger.retained(0, 3), torch.arange(4, dtype=torch.float32))
    assert ledger.retained(0, 2) is None
    ledger.gradient_of_step(3)  # a late gradient of the same step proves nothing
    assert ledger.retained(0, 3) is not None
    ledger.gradient_of_step(4)  # someone computed step 4: every rank finished step 3
    assert ledger.retained(0, 3) is None and ledger.retained_bytes() == 0
    ledger.retain(0, 3, param, torch.float32)  # too late to matter: not kept
    assert ledger.retained(0, 3) is None


def test_values_are_kept_in_the_wire_dtype_and_buffers_are_reused():
    ledger = StepLedger()
    ledger.retain(0, 0, torch.full((8,), 1.0 / 3.0), torch.bfloat16)
    first = ledger.retained(0, 0)
    assert first.dtype == torch.bfloat16 and torch.equal(first, torch.full((8,), 1.0 / 3.0).to(torch.bfloat16))
    ledger.gradient_of_step(1)
    ledger.retain(0, 1, torch.zeros(8), torch.bfloat16)
    assert ledger.retained(0, 1).data_ptr() == first.data_ptr()  # no allocation per step


def test_a_new_incarnation_replaces_the_old_one():
    ledger = StepLedger()
    assert ledger.register(1, b"a", 7) == "new"
    assert ledger.register(1, b"a", 7) == "same"
    assert ledger.register(1, b"b", 7) == "moved"
    assert ledger.register(1, b"c", 9) == "restarted"
    assert ledger.is_current(1, b"c") and not ledger.is_current(1, b"b")
    assert "no longer part of the job" in ledger.describe(1, b"b")


def test_the_outgoing_copy_is_kept_by_swapping_buffers():
    """A 16-bit wire: the copy that went out is kept as it is; the node sends the next values from a spare."""
    ledger = StepLedger()
    sent = torch.full((8,), 1.5, dtype=torch.bfloat16)
    spare = ledger.swap_kept(0, 2, sent)
    assert spare is not sent and spare.shape == sent.shape and spare.dtype == torch.bfloat16
    assert ledger.retained(0, 2) is sent
    spare.fill_(2.5)
    again = ledger.swap_kept(0, 3, spare)  # the next update: the step-2 values go back to the pool
    assert again is sent and ledger.retained(0, 3) is spare and ledger.retained(0, 2) is None
    ledger.gradient_of_step(5)
    assert ledger.swap_kept(0, 4, again) is again, "nobody can need step 4 any more: nothing is kept"
    assert ledger.retained_bytes() == 0


def test_a_buffer_filled_by_the_update_pass_is_kept():
    ledger = StepLedger()
    buffer = ledger.buffer_to_keep(1, 0, 4, torch.float32)
    assert buffer is not None
    buffer.copy_(torch.arange(4.0))
    ledger.keep(1, 0, buffer)
    assert torch.equal(ledger.retained(1, 0), torch.arange(4.0))
    assert ledger.buffer_to_keep(1, 1, 4, torch.float32) is buffer, "the step-0 values are let go and their buffer reused"
    ledger.gradient_of_step(3)
    assert ledger.buffer_to_keep(1, 2, 4, torch.float32) is None
