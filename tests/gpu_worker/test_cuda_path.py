"""The workers' CUDA path: gradients leave the GPU through pinned buffers, parameters come back through
pinned staging buffers and copies on a side stream. Skipped where torch sees no GPU.

The oracle is the CPU one: the node runs the same fp32 AdamW as ``torch.optim.AdamW(fused=True)`` on
the CPU, fed the gradients the GPU computed (copied to the host, summed in rank order, averaged).
"""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch

from gpu_worker import NonFiniteGradientError, RemoteAdamW, offload
from gpu_worker.layerwise.device_copy import HostToDevice, host_waitable_event, wait_for_stream, wait_on_host
from gpu_worker.models import GPT, GPTConfig
from tests.gpu_worker.harness import run_threads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=128)
STEPS = 4
WORLD_SIZE = 2
OPTIONS = dict(lr=3e-3, weight_decay=0.1, bucket_numel=8192, timeout_s=60)


@pytest.fixture(autouse=True)
def deterministic_kernels():
    """The same kernels on the same inputs give the same bits: no atomics-based reductions."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def tokens(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11 + step)
    data = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.block_size + 1), generator=generator)
    per = data.shape[0] // WORLD_SIZE
    part = data[rank * per : (rank + 1) * per].cuda()
    return part[:, :-1].contiguous(), part[:, 1:].contiguous()


def make_gpt(config: GPTConfig = CONFIG) -> GPT:
    torch.manual_seed(0)
    return GPT(config).cuda()


def train_offloaded(
    nodes: list[str],
    *,
    layerwise: bool,
    prefetch: int = 1,
    push_during_backward: bool = False,
    overlap_forward: bool = False,
    config: GPTConfig = CONFIG,
    bucket_numel: int | None = None,
) -> dict[str, torch.Tensor]:
    """Two worker threads on the GPU; returns rank 0's final parameters (checked equal on both ranks).
    ``push_during_backward``: 1 MiB buckets, whose copies out of the GPU start during backward;
    ``overlap_forward``: each block's next forward waits for its own values only."""
    models = [make_gpt(config) for _ in range(WORLD_SIZE)]
    results: dict[int, dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            model = models[rank]
            options = dict(nodes=nodes, rank=rank, world_size=WORLD_SIZE, **OPTIONS)
            if push_during_backward:
                options |= {"push_during_backward": True, "bucket_numel": 1 << 18}
            if bucket_numel is not None:
                options["bucket_numel"] = bucket_numel
            if overlap_forward:
                options |= {"overlap_forward": True, "module": model}
            opt = offload(model, model.blocks, prefetch=prefetch, **options) if layerwise else RemoteAdamW(model.named_parameters(), **options)
            for step in range(STEPS):
                _logits, loss = model(*tokens(step, rank))
                loss.backward()
                opt.step()
                opt.zero_grad()
            if not layerwise:
                for name, param in model.named_parameters():
                    assert param.device.type == "cuda", f"{name} left the GPU"
            if push_during_backward:  # autograd's device thread staged the large buckets' copies
                assert opt._session.pushes.sender.staged_pushes >= STEPS
                assert opt._session.pushes.sender.vouched_pushes >= STEPS  # summed on the device: the nodes read nothing
            if layerwise and bucket_numel is not None and bucket_numel * 4 >= 1 << 20:  # staged in backward, sent once landed
                assert opt._session.pushes.sender.staged_pushes >= STEPS and opt._session.pushes.sender.vouched_pushes >= STEPS
            # the nodes are on this host: gradients were copied off the GPU straight into their windows
            assert opt.shared_memory_bytes["sent_in_place"] > 0, opt.shared_memory_bytes
            # and values were copied up straight from their windows and boards, page-locked for the device
            assert opt.device_copy_bytes["direct"] > 0, opt.device_copy_bytes
            results[rank] = {name: value.cpu() for name, value in opt.gather_parameters().items()}
            opt.close()
        except BaseException as exc:
            errors.append(exc)

    run_threads(worker, WORLD_SIZE)
    if errors:
        raise errors[0]
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0]), "ranks disagree"
    return results[0]


def reference() -> dict[str, torch.Tensor]:
    """Each rank's gradient computed on the GPU, averaged on the CPU in rank order, fused AdamW on the CPU."""
    model = make_gpt()
    master = {name: p.detach().cpu().clone().requires_grad_(True) for name, p in model.named_parameters()}
    opt = torch.optim.AdamW(master.values(), fused=True, lr=OPTIONS["lr"], weight_decay=OPTIONS["weight_decay"])
    for step in range(STEPS):
        grads = []
        for rank in range(WORLD_SIZE):
            replica = copy.deepcopy(model)
            _logits, loss = replica(*tokens(step, rank))
            loss.backward()
            grads.append({name: p.grad.cpu() for name, p in replica.named_parameters()})
        for name, param in master.items():
            total = grads[0][name].clone()
            for rank in range(1, WORLD_SIZE):
                total += grads[rank][name]
            param.grad = total / WORLD_SIZE
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(master[name])
    return {name: p.detach() for name, p in master.items()}


@pytest.mark.parametrize(("push_during_backward", "overlap_forward"), [(False, False), (True, False), (True, True)], ids=["at-step", "early", "early-overlap"])
def test_full_model_on_cuda_is_bitwise_equal_to_fused_adamw(start_node, push_during_backward, overlap_forward):
    """With ``overlap_forward`` a layer that ran on stale values (its copy not waited for) would differ."""
    nodes = [start_node("node0").address, start_node("node1").address]
    got, want = train_offloaded(nodes, layerwise=False, push_during_backward=push_during_backward, overlap_forward=overlap_forward), reference()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name}: max diff {(got[name] - want[name]).abs().max():.3g}"


@pytest.mark.parametrize("prefetch", [0, 2])
def test_layerwise_on_cuda_is_bitwise_equal_to_full_model(start_node, prefetch):
    nodes = [start_node("node0").address]
    full = train_offloaded(nodes, layerwise=False)
    nodes = [start_node("node1").address]
    streamed = train_offloaded(nodes, layerwise=True, prefetch=prefetch)
    for name in full:
        assert torch.equal(streamed[name], full[name]), f"{name}: max diff {(streamed[name] - full[name]).abs().max():.3g}"


def test_layerwise_large_buckets_go_out_as_their_copies_land(start_node):
    """Buckets of 1 MiB in 3 MiB blocks: layer-wise backward stages their copies and sends each once
    landed, bitwise as the full model with the same buckets."""
    wide, numel = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=256), 1 << 18
    full = train_offloaded([start_node("node0").address], layerwise=False, config=wide, bucket_numel=numel)
    streamed = train_offloaded([start_node("node1").address], layerwise=True, config=wide, bucket_numel=numel)
    for name in full:
        assert torch.equal(streamed[name], full[name]), f"{name}: max diff {(streamed[name] - full[name]).abs().max():.3g}"


def test_a_nan_gradient_on_the_gpu_goes_without_the_workers_word_and_is_refused(start_node):
    model = make_gpt()
    opt = RemoteAdamW(model.named_parameters(), nodes=[start_node().address], push_during_backward=True, **(OPTIONS | {"bucket_numel": 1 << 18}))
    _logits, loss = model(*tokens(0, 0))
    loss.backward()
    opt.step()
    opt.zero_grad()
    vouched = opt._session.pushes.sender.vouched_pushes
    assert vouched > 0
    _logits, loss = model(*tokens(1, 0))
    (loss * float("nan")).backward()
    with pytest.raises(NonFiniteGradientError, match="NaN"):
        opt.step()
    assert opt._session.pushes.sender.vouched_pushes == vouched
    opt.close()


def test_a_host_thread_waits_for_the_gpu_asleep():
    """The worker's waits for copies sleep instead of spinning a core the node's update needs."""
    for wait in (lambda: wait_for_stream(torch.cuda.current_stream()), None):
        torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        torch.cuda._sleep(400_000_000)  # a few hundred milliseconds of GPU time
        if wait is None:
            event = host_waitable_event()
            event.record()
            wait_on_host(event)
            assert event.query()
        else:
            wait()
        assert torch.cuda.current_stream().query()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert wall > 0.05 and cpu < 0.5 * wall, f"waited {wall:.3f} s using {cpu:.3f} s of CPU"


def test_host_to_device_copies_are_staged_through_pinned_memory_on_a_side_stream():
    device = torch.device("cuda")
    copier = HostToDevice(device, staging_numel=1 << 16, staging_buffers=2)
    sources = [torch.randn(1 << 16) for _ in range(8)]  # more pieces than staging buffers: each is reused
    targets = [torch.empty(1 << 16, device=device) for _ in sources]
    copier.begin()
    for target, source in zip(targets, sources, strict=True):
        copier.copy(target, source)
    event = copier.record()
    assert event is not None
    HostToDevice.wait(event)
    for target, source in zip(targets, sources, strict=True):
        assert torch.equal(target.cpu(), source)
    assert all(buffer.is_pinned() for buffer, _ in copier._staging)
