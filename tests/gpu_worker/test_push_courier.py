"""Pushes during backward from the courier thread (:mod:`gpu_worker.exchange.push_courier`): on a GPU autograd
runs the hooks on its device thread, which stages each bucket's copy; the courier sends it once
landed, and ``step()`` sends what it did not. Here a backward on a thread other than the optimizer's
plays autograd's device thread (the staged copies are then CPU gathers), against a real node."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import torch
from torch import nn

from gpu_worker import RemoteAdamW
from gpu_worker.exchange.push_courier import PushCourier

BUCKET_NUMEL = 1 << 18  # 1 MiB of fp32: too large for a batch of small buckets, so each is staged


def test_the_courier_sends_in_order_and_nothing_of_a_stopped_backward():
    sent: list[int] = []
    gate = threading.Event()

    def wait_copied(bucket_id: int) -> None:
        if bucket_id == 2:
            gate.wait(10)

    courier = PushCourier(wait_copied, sent.append)
    for bucket_id in (5, 4, 2, 1):
        courier.offer(bucket_id)
    deadline = time.monotonic() + 10
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    courier.stop()  # step() takes over: bucket 2 (its copy not landed) and 1 stay for it
    gate.set()
    time.sleep(0.2)
    assert sent == [5, 4]
    courier.offer(7)  # the next backward
    deadline = time.monotonic() + 10
    while len(sent) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent == [5, 4, 7] and courier.sent == 3
    courier.close()


def test_a_failed_push_is_left_to_step(caplog):
    calls: list[int] = []

    def send(bucket_id: int) -> None:
        calls.append(bucket_id)
        raise ConnectionError("gone")

    courier = PushCourier(lambda _bucket_id: None, send)
    courier.offer(1)
    courier.offer(2)  # after a failure the courier sends nothing more of this backward
    deadline = time.monotonic() + 10
    while courier._queue.qsize() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    courier.stop()
    assert calls == [1] and courier.sent == 0
    assert "step() sends it again" in caplog.text
    courier.close()


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 4))


def test_pushes_leave_during_a_backward_on_another_thread_bitwise_as_adamw(start_node):
    model, reference = make_model(), make_model()
    opt = RemoteAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, nodes=[start_node().address], bucket_numel=BUCKET_NUMEL, push_during_backward=True)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    staged_buckets = sum(1 for bucket in opt._session.buckets if bucket.numel * 4 >= 1 << 20)
    assert staged_buckets >= 2
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        x, y = torch.randn(16, 512, generator=generator), torch.randn(16, 4, generator=generator)
        before = opt._hooks.courier.sent
        backward = threading.Thread(target=lambda x=x, y=y: (model(x) - y).pow(2).mean().backward())
        backward.start()
        backward.join(30)
        deadline = time.monotonic() + 10
        while opt._hooks.courier.sent < before + staged_buckets and time.monotonic() < deadline:
            time.sleep(0.005)
        assert opt._hooks.courier.sent == before + staged_buckets, f"step {step}: the courier sent {opt._hooks.courier.sent - before}"
        opt.step()
        opt.zero_grad()
        (reference(x) - y).pow(2).mean().backward()
        torch_opt.step()
        torch_opt.zero_grad()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, want)
    opt.close()


def test_the_courier_does_not_keep_its_owner_alive():
    """Its thread holds the owner's methods weakly: an optimizer nobody closes is still collected
    (and closes its connections), and the thread ends with it."""

    class Owner:
        def __init__(self) -> None:
            self.sent: list[int] = []

        def wait(self, _bucket_id: int) -> None:
            pass

        def send(self, bucket_id: int) -> None:
            self.sent.append(bucket_id)

    owner = Owner()
    courier = PushCourier(owner.wait, owner.send)
    courier.offer(3)
    deadline = time.monotonic() + 10
    while owner.sent != [3] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert owner.sent == [3]
    thread, alive = courier._thread, weakref.ref(owner)
    del owner
    gc.collect()
    assert alive() is None
    courier.offer(4)  # finds its owner gone and ends
    thread.join(10)
    assert not thread.is_alive()
