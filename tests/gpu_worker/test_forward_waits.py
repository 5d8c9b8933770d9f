"""``overlap_forward``: step() returns with the gradients out, and the next forward waits for each
module's values as it reaches it; everything that reads parameters otherwise waits for the whole step."""

from __future__ import annotations

import copy
import threading
import weakref

import pytest
import torch

from gpu_worker import NonFiniteGradientError, RemoteAdamW

BUCKET = 100_000  # 400 KB: each bucket's values come alone (not in a batch), one message at a time


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 4))


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 256, generator=torch.Generator().manual_seed(step))


def overlapped(address: str, model: torch.nn.Module, **options) -> RemoteAdamW:
    return RemoteAdamW(
        model.parameters(), lr=1e-2, nodes=[address], rank=0, world_size=1, bucket_numel=BUCKET, overlap_forward=True, module=model, timeout_s=60, **options
    )


def buckets_of(opt: RemoteAdamW, module: torch.nn.Module) -> set[int]:
    index = {id(p): i for i, p in enumerate(opt._params)}
    return {b for p in module.parameters() for b in opt._hooks.readiness.param_buckets[index[id(p)]]}


@pytest.mark.parametrize("early", [False, True], ids=["push-at-step", "push-during-backward"])
def test_each_module_waits_for_its_own_buckets_and_training_stays_bitwise(start_node, early):
    model = make_model()
    reference = copy.deepcopy(model)
    opt = overlapped(start_node().address, model, push_during_backward=early)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    first, last = buckets_of(opt, model[0]), buckets_of(opt, model[4])
    assert max(first) < min(last), "the layout follows the parameters' order"
    session = opt._session
    awaited: list[int] = []
    waits = opt._hooks.forward_waits
    await_upto = waits._await_upto
    waits._await_upto = lambda upto: (awaited.append(upto), await_upto(upto))[1]
    for step in range(4):
        x = batch(step)
        if step > 0:
            # The forward's first layer: its buckets are in (and what else had come), the step still open.
            hidden = model[0](x)
            assert session.awaiting_values and not (first & session._values.waiting)
            assert all(torch.equal(a, b) for a, b in zip(model[0].parameters(), reference[0].parameters(), strict=True))
            del hidden
        awaited.clear()
        model(x).pow(2).mean().backward()  # the root's forward ends the step: every bucket in before backward
        assert not session.awaiting_values
        if step > 0:  # each layer waited for the buckets up to its own last one, no further
            assert awaited == [max(first), max(buckets_of(opt, model[2])), max(last)]
        opt.step()
        assert session.awaiting_values, "step() returned with the values still to come"
        opt.zero_grad()
        reference(x).pow(2).mean().backward()
        torch_opt.step()
        torch_opt.zero_grad()
    opt.synchronize()
    assert not session.awaiting_values
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    opt.close()


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "let-go"])
def test_the_step_gradients_live_until_its_values_are_in_unless_let_go(start_node, keep):
    """Kept (the default), a step's gradients outlive ``zero_grad()`` until the next forward brought its
    values in (a node restarted meanwhile gets them again); let go (``keep_step_gradients=False``),
    ``zero_grad()`` frees them at once, so the next forward's activations do not come on top of them,
    and the values are the same."""
    model, reference = make_model(), make_model()
    opt = overlapped(start_node().address, model, keep_step_gradients=keep)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    for step in range(3):
        model(batch(step)).pow(2).mean().backward()
        grads = [weakref.ref(p.grad) for p in model.parameters()]
        opt.step()
        assert opt._session.awaiting_values, "step() returned with the values still to come"
        opt.zero_grad()
        alive = sum(g() is not None for g in grads)
        assert alive == (len(grads) if keep else 0), f"{alive} of {len(grads)} gradients alive after zero_grad()"
        reference(batch(step)).pow(2).mean().backward()
        torch_opt.step()
        torch_opt.zero_grad()
    opt.synchronize()
    assert all(g() is None for g in grads), "the last step's gradients go once its values are in"
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    opt.close()


def test_everything_that_reads_the_step_waits_for_it(start_node):
    model = make_model()
    opt = overlapped(start_node().address, model, max_grad_norm=1e6)

    def stepped() -> None:
        model(batch(0)).pow(2).mean().backward()
        opt.step()
        assert opt._session.awaiting_values

    stepped()
    state = model.state_dict()  # the module's state dict: the new values
    assert not opt._session.awaiting_values
    assert all(torch.equal(state[name], p) for name, p in model.named_parameters())
    stepped()
    opt.zero_grad(set_to_none=False)  # zeroing in place: the held gradients must not change under a pending step
    assert not opt._session.awaiting_values
    stepped()
    assert opt.last_grad_norm is not None and not opt._session.awaiting_values
    stepped()
    assert opt.remote_step == 4 and not opt._session.awaiting_values
    stepped()
    opt.step()  # a second step() with no forward between: the first one's values first
    assert opt.remote_step == 6
    stepped()
    assert "state" in opt.state_dict() and not opt._session.awaiting_values
    stepped()
    opt.close()  # the last step's values are in before the connections close
    assert opt._session.step == 8


def test_a_forward_on_another_thread_is_refused_while_values_are_awaited(start_node):
    model = make_model()
    opt = overlapped(start_node().address, model)
    model(batch(0)).pow(2).mean().backward()
    opt.step()
    errors: list[BaseException] = []

    def forward() -> None:
        try:
            model(batch(1))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=forward)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError) and "synchronize()" in str(errors[0])
    opt.synchronize()
    model(batch(1))  # nothing awaited: any thread may run forward
    opt.close()


def test_a_refused_gradient_is_raised_by_the_next_forward_and_a_retry_finishes_the_step(start_node):
    model = make_model()
    reference = copy.deepcopy(model)
    opt = overlapped(start_node().address, model)  # the node refuses non-finite gradients by default
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    x = batch(0)
    model(x).pow(2).mean().backward()
    good = [p.grad.clone() for p in model.parameters()]
    model[2].weight.grad[0, 0] = float("nan")
    opt.step()
    with pytest.raises(NonFiniteGradientError, match="rank 0"):
        model(x)
    for p, grad in zip(model.parameters(), good, strict=True):
        p.grad = grad
    opt.step()  # the retry: the refused bucket goes again
    model(x)
    reference(x).pow(2).mean().backward()
    torch_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    opt.close()


def test_overlap_forward_needs_the_module_that_holds_every_parameter(node):
    """Refused before any node hears of the job (the address given here answers nothing), and a param
    group added later must be held by the module too."""
    model = make_model()
    nowhere = ["tcp://127.0.0.1:9"]
    with pytest.raises(ValueError, match="needs module="):
        RemoteAdamW(model.parameters(), nodes=nowhere, rank=0, world_size=1, overlap_forward=True)
    extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not parameters of the module"):
        RemoteAdamW([*model.parameters(), extra], nodes=nowhere, rank=0, world_size=1, overlap_forward=True, module=model, connect_timeout_s=1)
    opt = overlapped(node.address, model)
    with pytest.raises(ValueError, match="not parameters of the module"):
        opt.add_param_group({"params": [extra]})
    assert len(opt.param_groups) == 1
    model(batch(0)).pow(2).mean().backward()
    opt.step()
    model(batch(1))  # the hooks still work
    assert not opt._session.awaiting_values
    opt.close()


def test_a_param_group_added_later_is_waited_for_too(start_node):
    """Progressive unfreezing with overlap_forward: the hooks are made again for the new buckets, and
    training stays bitwise torch's AdamW that added the same group at the same step."""
    model = make_model()
    reference = copy.deepcopy(model)
    for net in (model, reference):
        net[4].requires_grad_(False)
    opt = RemoteAdamW(
        model[0:3].parameters(), lr=1e-2, nodes=[start_node().address], rank=0, world_size=1, bucket_numel=BUCKET, overlap_forward=True, module=model
    )
    torch_opt = torch.optim.AdamW(reference[0:3].parameters(), lr=1e-2, fused=True)
    for step in range(4):
        if step == 2:
            for net, optimizer in ((model, opt), (reference, torch_opt)):
                net[4].requires_grad_(True)
                optimizer.add_param_group({"params": list(net[4].parameters())})
        x = batch(step)
        for net, optimizer in ((model, opt), (reference, torch_opt)):
            net(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    opt.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    opt.close()
