"""8-bit moments on a node against the peers' 8-bit AdamW over 100 steps: torchao's ``AdamW8bit``
(block 256) and bitsandbytes' CPU ``AdamW8bit`` (block 256, 8 bits from 4,096 elements; this version
clips no gradient percentile), with torch's fp32 ``AdamW`` as the yardstick.

The three quantize alike (blockwise absmax, the dynamic map) but round and update in their own
arithmetic (torch's fused kernel on the node, ``lerp`` in torchao, bitsandbytes' own order), so over
100 steps their trajectories part. Measured here (max over parameters; ``rel``: the difference's norm
over the parameter's; the parameters moved up to 0.062 from their initial values):

=====================  ========  ========
pair                   max abs   max rel
=====================  ========  ========
netoptim vs torchao    0.00092   0.0036
netoptim vs bnb        0.00113   0.0045
torchao vs bnb         0.00118   0.0045
netoptim vs fp32       0.00159   0.0066
torchao vs fp32        0.00148   0.0066
bnb vs fp32            0.00131   0.0067
=====================  ========  ========

The tolerance: netoptim's difference from either peer at most 1.5x the peers' difference from each
other, in both measures (measured: at most 1.004x), and under 1% relative. The fp32 yardstick says
the moments were compressed indeed: netoptim is nearer torchao than torchao is to fp32 AdamW.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

with warnings.catch_warnings():  # both print warnings about GPU kernels they cannot load on CPU
    warnings.simplefilter("ignore")
    import bitsandbytes
    import torchao.optim as torchao_optim

from gpu_worker import RemoteAdamW
from tests.gpu_worker.harness import run_threads

WORLD = 2
STEPS = 100
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
PEER_FACTOR = 1.5  # netoptim vs a peer, at most this many times the peers' difference from each other
MAX_REL = 1e-2  # and at most this relative difference from either peer (measured: 0.45%)

Params = list[torch.Tensor]


def make_model() -> nn.Module:
    """Three weights of 8,192 elements (32 whole blocks of 256: compressed by all three) and biases of
    256 and 32 (under 4,096: fp32 moments everywhere)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 32), nn.Tanh(), nn.Linear(32, 256))


def groups(model: nn.Module, named: bool) -> list[dict]:
    pick = (lambda n, p: (n, p)) if named else (lambda n, p: p)
    weights = [pick(n, p) for n, p in model.named_parameters() if p.dim() == 2]
    biases = [pick(n, p) for n, p in model.named_parameters() if p.dim() == 1]
    return [{"params": weights}, {"params": biases, "weight_decay": 0.0}]


def shard(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 32, generator=generator), torch.randn(8, 256, generator=generator)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def offloaded(nodes: list[str]) -> Params:
    """Two workers (threads) training with 8-bit moments on the nodes; rank 0's final parameters."""
    models = [make_model() for _ in range(WORLD)]
    results: dict[int, Params] = {}
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            model = models[rank]
            # buckets of 8,192: each weight a bucket of its own, whole blocks, as the peers block it
            opt = RemoteAdamW(groups(model, named=True), **HYPER, nodes=nodes, rank=rank, world_size=WORLD, bucket_numel=8192, moments="8bit", timeout_s=60)
            for step in range(1, STEPS + 1):
                loss_of(model, *shard(step, rank)).backward()
                opt.step()
                opt.zero_grad()
            values = opt.gather_parameters()
            results[rank] = [values[name] for name, _ in model.named_parameters()]
            opt.close()
        except BaseException as exc:
            errors.append(exc)

    run_threads(worker, WORLD)
    if errors:
        raise errors[0]
    return results[0]


def in_one_process(make_optimizer: Callable[[list[dict]], torch.optim.Optimizer]) -> Params:
    """The same training in one process: each step's gradient the two shards' gradients summed in rank
    order and halved, as the node averages them."""
    model = make_model()
    params = list(model.parameters())
    optimizer = make_optimizer(groups(model, named=False))
    for step in range(1, STEPS + 1):
        per_rank = []
        for rank in range(WORLD):
            model.zero_grad(set_to_none=True)
            loss_of(model, *shard(step, rank)).backward()
            per_rank.append([p.grad for p in params])
        for p, first, second in zip(params, *per_rank, strict=True):
            p.grad = (first + second) / WORLD
        optimizer.step()
    return [p.detach().clone() for p in params]


def differences(a: Params, b: Params) -> tuple[float, float]:
    """Max abs difference, and max over parameters of the difference's norm over ``b``'s."""
    max_abs = max(float((x.view(-1) - y.view(-1)).abs().max()) for x, y in zip(a, b, strict=True))
    max_rel = max(float((x.view(-1) - y.view(-1)).norm() / y.norm()) for x, y in zip(a, b, strict=True))
    return max_abs, max_rel


def test_8bit_moments_are_within_the_peers_tolerance(start_node, monkeypatch):
    ours = offloaded([start_node().address])
    with monkeypatch.context() as patch:
        # torchao compiles its step with inductor, minutes of C++ builds on CPU for the same arithmetic
        patch.setattr(torch, "compile", lambda fn, **_: fn)
        torchao_run = in_one_process(lambda g: torchao_optim.AdamW8bit(g, **HYPER, block_size=256))
    bnb_run = in_one_process(lambda g: bitsandbytes.optim.AdamW8bit(g, **HYPER, min_8bit_size=4096))
    fp32_run = in_one_process(lambda g: torch.optim.AdamW(g, **HYPER))

    measured = {
        "netoptim vs torchao": differences(ours, torchao_run),
        "netoptim vs bnb": differences(ours, bnb_run),
        "torchao vs bnb": differences(torchao_run, bnb_run),
        "netoptim vs fp32": differences(ours, fp32_run),
        "torchao vs fp32": differences(torchao_run, fp32_run),
        "bnb vs fp32": differences(bnb_run, fp32_run),
    }
    shown = "; ".join(f"{pair}: abs {a:.3g}, rel {r:.3g}" for pair, (a, r) in measured.items())
    peers_abs, peers_rel = measured["torchao vs bnb"]
    for pair in ("netoptim vs torchao", "netoptim vs bnb"):
        max_abs, max_rel = measured[pair]
        assert max_abs <= PEER_FACTOR * peers_abs and max_rel <= PEER_FACTOR * peers_rel, f"{pair} is further than the peers from each other: {shown}"
        assert max_rel <= MAX_REL, f"{pair} is over {MAX_REL:.1%} relative: {shown}"
    # compressed indeed: nearer the 8-bit peer than fp32 AdamW is
    assert measured["netoptim vs torchao"][1] < measured["torchao vs fp32"][1], shown
    assert all(torch.isfinite(p).all() for p in ours)
