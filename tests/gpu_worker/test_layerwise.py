"""Layer-wise mode against full-model mode on a GPT, its memory window, and what it refuses."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gpu_worker import NodeError, RemoteAdamW, offload
from gpu_worker.layerwise.units import kept_for_backward
from gpu_worker.models import GPT, GPTConfig, gpt_initializer
from tests.gpu_worker.harness import run_threads
from tests.ports import restartable_address

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=6, n_head=2, n_embd=32)
STEPS = 4


def tokens(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7 + step)
    data = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.block_size + 1), generator=generator)
    per = data.shape[0] // world_size
    part = data[rank * per : (rank + 1) * per]
    return part[:, :-1].contiguous(), part[:, 1:].contiguous()


class CheckpointedGPT(GPT):
    """The same GPT with activation checkpointing around every block."""

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def make_gpt(kind: str = "plain") -> GPT:
    torch.manual_seed(0)
    model = (CheckpointedGPT if kind == "checkpointed" else GPT)(CONFIG)
    if kind == "tied":
        model.head.weight = model.wte.weight
    return model


def train(
    nodes: list[str], *, layerwise: bool, kind: str = "plain", world_size: int = 2, prefetch: int = 1, steps: int = STEPS, keep_for_backward: int = 0
) -> tuple[dict, list]:
    """Train ``world_size`` worker threads; returns rank 0's final parameters and every rank's optimizer stats."""
    results: dict[int, dict[str, torch.Tensor]] = {}
    stats: list = [None] * world_size
    errors: list[BaseException] = []
    models = [make_gpt(kind) for _ in range(world_size)]  # here: the global RNG is not for threads

    def worker(rank: int) -> None:
        try:
            model = models[rank]
            options = dict(nodes=nodes, rank=rank, world_size=world_size, lr=3e-3, weight_decay=0.1, bucket_numel=4096, timeout_s=60)
            if layerwise:
                opt = offload(model, model.blocks, prefetch=prefetch, keep_for_backward=keep_for_backward, **options)
            else:
                opt = RemoteAdamW(model.named_parameters(), **options)
            for step in range(steps):
                _logits, loss = model(*tokens(step, rank, world_size))
                loss.backward()
                opt.step()
                opt.zero_grad()
            results[rank] = opt.gather_parameters()
            stats[rank] = opt.stream_stats
            opt.close()
        except BaseException as exc:
            errors.append(exc)

    run_threads(worker, world_size)
    if errors:
        raise errors[0]
    for rank in range(1, world_size):
        assert all(torch.equal(results[0][k], results[rank][k]) for k in results[0]), "ranks disagree"
    return results[0], stats


@pytest.mark.parametrize("kind", ["plain", "checkpointed", "tied"])
def test_layerwise_equals_full_model_bitwise(start_node, kind):
    full = train([start_node("full").address], layerwise=False, kind=kind)[0]
    streamed, stats = train([start_node("a").address, start_node("b").address], layerwise=True, kind=kind)
    assert full.keys() == streamed.keys()
    for name in full:
        assert torch.equal(full[name], streamed[name]), f"{name} differs between layer-wise and full-model training"
    assert stats[0].fetches > 0 and stats[0].fetched_bytes > 0
    if kind == "tied":
        assert "head.weight" not in streamed, "a tied parameter is one parameter"


def unit_bytes(model: GPT) -> tuple[int, int, int]:
    """(root unit bytes, largest block bytes, all bytes) of a GPT's parameters."""
    block = max(sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks)
    total = sum(p.numel() * 4 for p in model.parameters())
    return total - sum(p.numel() * 4 for p in model.blocks.parameters()), block, total


def fetches_of_steps(opt: RemoteAdamW, model: GPT, steps: int) -> list[int]:
    """Train ``steps`` steps on one rank; the unit fetches of each (none held between steps)."""
    counts = []
    for step in range(steps):
        fetched = opt.stream_stats.fetches
        _logits, loss = model(*tokens(step, 0, 1))
        loss.backward()
        opt.step()
        assert opt._streamer.resident_param_bytes() == 0, "between steps the worker holds no parameters"
        counts.append(opt.stream_stats.fetches - fetched)
    return counts


@pytest.mark.parametrize("prefetch", [0, 1, pytest.param(2, marks=pytest.mark.slow)])
def test_parameter_memory_stays_within_the_prefetch_window(start_node, prefetch):
    """Measured from the parameter storages at every hook, not from the streamer's bookkeeping."""
    node = start_node()
    model = make_gpt()
    root, block, total = unit_bytes(model)
    opt = offload(model, model.blocks, nodes=[node.address], prefetch=prefetch, bucket_numel=4096, timeout_s=30)
    assert opt._streamer.resident_param_bytes() == 0, "after connecting the worker holds no parameters"
    opt.stream_stats.peak_param_bytes = 0  # this model was built whole; what matters is training
    held_during: list[int] = []
    probes = [b.register_forward_hook(lambda *_: held_during.append(opt._streamer.resident_param_bytes())) for b in model.blocks]
    blocks = len(model.blocks)
    # the root unit, every block for forward, and again for backward but the last prefetch + 1, kept from forward
    assert fetches_of_steps(opt, model, 2) == [1 + blocks + blocks - min(blocks, prefetch + 1)] * 2
    peak = opt.stream_stats.peak_param_bytes
    window = root + (prefetch + 1) * block  # the unit computing and the ones prefetched
    print(f"\nprefetch {prefetch}: peak {peak} B, window {window} B, whole model {total} B")
    assert max(held_during) <= window and peak <= window, f"held {peak} bytes, more than the root unit and {prefetch + 1} blocks ({window})"
    assert peak < total
    for probe in probes:
        probe.remove()
    opt.close()


@pytest.mark.parametrize("kept_blocks", [3, CONFIG.n_layer])
def test_units_kept_for_backward_are_fetched_once_and_change_nothing(start_node, kept_blocks):
    """keep_for_backward: the last units forward ran stay for backward, as many as the bytes hold;
    backward fetches none of them again, the memory held is at most those units more, and the
    values trained are the full model's, bitwise."""
    model = make_gpt()
    root, block, _total = unit_bytes(model)
    keep = kept_blocks * block + block // 2  # half a block more: not enough for another
    prefetch = 1
    node = start_node()
    opt = offload(model, model.blocks, nodes=[node.address], prefetch=prefetch, keep_for_backward=keep, bucket_numel=4096, timeout_s=30)
    opt.stream_stats.peak_param_bytes = 0
    blocks = len(model.blocks)
    assert fetches_of_steps(opt, model, 2) == [1 + blocks + blocks - kept_blocks] * 2, "backward fetches only the units not kept"
    peak = opt.stream_stats.peak_param_bytes
    assert (prefetch + 1) * block + root < peak <= root + (kept_blocks + prefetch + 1) * block
    opt.close()
    full = train([start_node("full").address], layerwise=False)[0]
    kept = train([start_node("kept").address], layerwise=True, keep_for_backward=keep)[0]
    for name in full:
        assert torch.equal(full[name], kept[name]), f"{name} differs from full-model training"


def test_which_units_stay_for_backward():
    """Counted back from the last unit: at least prefetch + 1, then as many as fit, stopping at the
    first that does not (no unit skipped to fit a smaller one before it)."""
    assert kept_for_backward([10, 10, 10, 10], 1, 0) == (2, 20)
    assert kept_for_backward([10, 10, 10, 10], 1, 35) == (1, 30)
    assert kept_for_backward([10, 10, 10, 10], 1, 40) == (0, 40)
    assert kept_for_backward([5, 50, 10, 10], 0, 60) == (2, 20), "the 50 does not fit: the 5 before it is not taken either"
    assert kept_for_backward([10, 10], 5, 0) == (0, 20), "a prefetch longer than the model keeps it all"
    assert kept_for_backward([], 1, 100) == (0, 0)
    with pytest.raises(ValueError, match="keep_for_backward"):
        offload(make_gpt(), make_gpt().blocks, keep_for_backward=-1)


def test_meta_model_is_initialized_unit_by_unit_and_trains(start_node):
    node = start_node()
    with torch.device("meta"):
        model = GPT(CONFIG)
    assert all(p.is_meta for p in model.parameters())
    opt = offload(model, model.blocks, nodes=[node.address], init_fn=gpt_initializer(CONFIG), bucket_numel=4096, timeout_s=30)
    assert not any(p.is_meta for p in model.parameters())
    root, block, _total = unit_bytes(model)
    assert opt.stream_stats.peak_param_bytes == max(root, block), "rank 0 materialized one unit at a time"
    values = opt.gather_parameters()
    assert abs(values["blocks.0.mlp.0.weight"].std().item() - 0.02) < 0.005 and torch.all(values["blocks.0.ln_1.weight"] == 1)
    assert abs(values["blocks.0.attn.proj.weight"].std().item() - 0.02 / math.sqrt(2 * CONFIG.n_layer)) < 0.002
    losses = []
    for step in range(8):
        _logits, loss = model(*tokens(step % 2, 0, 1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    opt.close()


def test_gradient_accumulation_in_no_sync(start_node):
    """Two micro-batches accumulated under no_sync equal one step on their summed loss in full mode."""
    results = {}
    for layerwise in (False, True):
        node = start_node(f"node-{layerwise}")
        model = make_gpt()
        options = dict(nodes=[node.address], lr=3e-3, bucket_numel=4096, timeout_s=30)
        opt = offload(model, model.blocks, **options) if layerwise else RemoteAdamW(model.named_parameters(), **options)
        for step in range(2):
            with opt.no_sync():
                model(*tokens(step, 0, 2))[1].backward()
            model(*tokens(step, 1, 2))[1].backward()
            opt.step()
            opt.zero_grad()
        results[layerwise] = opt.gather_parameters()
        opt.close()
    assert all(torch.equal(results[False][k], results[True][k]) for k in results[False])


def test_modules_that_cannot_be_streamed_as_asked(start_node):
    node = start_node()
    model = make_gpt()
    outsider = nn.Linear(2, 2)
    cases = [
        ([], "at least one unit"),
        ([model], "whole model cannot be a unit"),
        ([outsider], "not a submodule"),
        ([model.blocks[0], model.blocks[0]], "listed twice"),
        ([model.blocks[0], model.blocks[0].mlp], "cannot nest"),
        ([model.blocks[0].mlp[1]], "no trainable parameters"),
    ]
    for units, message in cases:
        with pytest.raises(ValueError, match=message):
            offload(model, units, nodes=[node.address])
    with pytest.raises(ValueError, match="prefetch"):
        offload(model, model.blocks, nodes=[node.address], prefetch=-1)
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(2, 2), nn.Module())
        meta[1].weight = nn.Parameter(torch.empty(3))
    with pytest.raises(ValueError, match="init_fn"):
        offload(meta, [meta[0]], nodes=[node.address])


def test_layerwise_and_full_model_workers_cannot_share_a_job(start_node):
    node = start_node()
    models = [make_gpt(), make_gpt()]
    first = offload(models[0], models[0].blocks, nodes=[node.address], rank=0, world_size=2, timeout_s=10)
    with pytest.raises(NodeError, match=r"mode differs \(this worker has 'full'\)"):
        RemoteAdamW(models[1].named_parameters(), nodes=[node.address], rank=1, world_size=2, timeout_s=10)
    first.close()


def test_a_node_that_dies_mid_fetch_is_a_clear_error(start_node):
    node = start_node(listen=restartable_address())  # no other test's node gets its port while this worker retries it
    model = make_gpt()
    opt = offload(model, model.blocks, nodes=[node.address], bucket_numel=4096, timeout_s=2)
    model(*tokens(0, 0, 1))[1].backward()
    opt.step()
    node.process.kill()
    node.process.wait()
    with pytest.raises(TimeoutError, match=r"unit '<root>' is missing .* no answer \(is it running\?\)"):
        model(*tokens(1, 0, 1))
    opt.close()


def test_a_small_push_window_throttles_backward_and_changes_nothing(start_node):
    """With room for one bucket of unconsumed gradients, every push waits for the previous one's update."""
    reference = train([start_node("wide").address], layerwise=True, world_size=1, steps=2)[0]
    node = start_node("narrow")
    model = make_gpt()
    opt = offload(model, model.blocks, nodes=[node.address], lr=3e-3, weight_decay=0.1, bucket_numel=4096, push_window_bytes=4096 * 4, timeout_s=30)
    for step in range(2):
        _logits, loss = model(*tokens(step, 0, 1))
        loss.backward()
        assert sum(opt._session.pacer._in_flight.values()) <= 4096 * 4
        opt.step()
    narrow = opt.gather_parameters()
    opt.close()
    assert all(torch.equal(reference[k], narrow[k]) for k in reference)


def test_large_buckets_go_out_as_their_copies_land_bitwise_as_adamw(start_node):
    """Buckets large enough to skip batching are staged in backward's hook and sent as their copies
    land (here at once: a CPU copy is done when made), with a push window of one bucket: bitwise as
    torch's AdamW, every such bucket sent from its staged copy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 4))
    reference = copy.deepcopy(model)
    numel = 1 << 18  # 1 MiB of fp32: not batched
    opt = offload(
        model, [model[0], model[2]], nodes=[start_node().address], lr=1e-3, weight_decay=0.1, bucket_numel=numel, push_window_bytes=4 * numel, timeout_s=30
    )
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(16, 512, generator=generator), torch.randn(16, 4, generator=generator)
        F.mse_loss(model(x), y).backward()
        opt.step()
        F.mse_loss(reference(x), y).backward()
        torch_opt.step()
        torch_opt.zero_grad()
    assert opt._session.pushes.sender.staged_pushes >= 3 * 2  # each Linear(512, 512) weight fills a bucket
    values = opt.gather_parameters()
    opt.close()
    for name, want in reference.named_parameters():
        assert torch.equal(values[name], want.detach()), name
