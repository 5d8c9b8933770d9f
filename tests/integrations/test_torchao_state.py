"""8-bit optimizer state between netoptim and torchao's ``AdamW8bit``, both ways, against real nodes.

netoptim to torchao: two workers train with ``moments="8bit"``, ``state_dict()`` (the moments decoded
to fp32) goes through :func:`~netoptim.integrations.torchao_state.to_torchao_8bit` into torchao's
``AdamW8bit`` on a fresh copy of the model, and torchao steps on. torchao to netoptim: torchao trains,
and ``RemoteAdamW.load_state_dict`` takes its state dict as it is (``OptimState8bit`` moments).

Both ways the 8-bit moments are quantized again from decoded values (torchao's ``copy_`` into its
subclass; the node's encoder, the same arithmetic). That is exact where the block's largest magnitude
is a positive value: it decoded to the scale itself (the map's top, 1.0), so the scale and every code
come back. The signed map's lowest value is about -0.993, not -1, so a first-moment block whose
largest magnitude is negative decodes to an absmax 0.993 times its scale, and quantizing it again
takes that absmax as its scale: its values come back 0.993 times as large where the code stays, within
one step of the map in any case (measured: at most 0.0070 of the block's absmax, half the map's
widest step; the codes themselves barely move: 24,575 of 24,576 as torchao held them, through fp32
moments on the nodes and back). So:

* ``exp_avg_sq`` (unsigned map, top 1.0 and no negatives) and the fp32 moments (biases) are bitwise;
* an ``exp_avg`` block is bitwise exactly when its largest value is greater than minus its smallest
  (measured: 13 to 20 of each weight's 32 blocks; the others are within one step);
* loaded into fp32 moments on the nodes, torchao's dequantized moments are kept bitwise.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch import nn

with warnings.catch_warnings():  # torchao warns about GPU kernels it cannot load on CPU
    warnings.simplefilter("ignore")
    torchao_optim = pytest.importorskip("torchao.optim", reason="the peer optimizer: pip install 'netoptim-train[test]'")
    from torchao.optim.quant_utils import create_dynamic_map
    from torchao.optim.subclass_8bit import OptimState8bit

from gpu_worker import RemoteAdamW
from gpu_worker.optimizer_state import plain_tensor
from netoptim.integrations.torchao_state import quantized_by_torchao, to_torchao_8bit
from tests.gpu_worker.harness import run_threads

WORLD = 2
STEPS = 5
BLOCK = 256
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
MOMENTS = ("exp_avg", "exp_avg_sq")
# The signed map's widest step between neighbouring values, as a fraction of a block's scale: one
# quantization step at most (the re-quantized blocks measured at most half of it, 0.0070).
SIGNED_MAP = torch.tensor(create_dynamic_map(signed=True))
ONE_STEP = float(SIGNED_MAP.diff().max())
MIN_SAME_CODES = 0.99  # share of exp_avg codes unchanged by the re-quantization (measured: 0.99996)
MIN_EXACT_BLOCKS = 0.25  # share of exp_avg blocks bitwise (measured: 0.41 to 0.63; compare_8bit's rule says which)


def make_model() -> nn.Module:
    """Three weights of 8,192 elements (32 whole blocks: 8-bit in both) and biases of 256 and 32
    (under 4,096 elements: fp32 in both)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 32), nn.Tanh(), nn.Linear(32, 256))


def groups(model: nn.Module, named: bool) -> list[dict]:
    pick = (lambda n, p: (n, p)) if named else (lambda n, p: p)
    weights = [pick(n, p) for n, p in model.named_parameters() if p.dim() == 2]
    biases = [pick(n, p) for n, p in model.named_parameters() if p.dim() == 1]
    return [{"params": weights}, {"params": biases, "weight_decay": 0.0}]


def in_state_order(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters by their index in the state dicts: over the groups (weights, then biases)."""
    return [pair for group in groups(model, named=True) for pair in group["params"]]


def shard(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 32, generator=generator), torch.randn(8, 256, generator=generator)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


@pytest.fixture
def eager_torchao(monkeypatch):
    """torchao compiles its step with inductor, minutes of C++ builds on CPU for the same arithmetic."""
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)


def decoded(value: torch.Tensor) -> torch.Tensor:
    return value.dequantize() if isinstance(value, OptimState8bit) else value


def compare_8bit(got: torch.Tensor, want: torch.Tensor, what: str) -> tuple[int, int]:
    """Assert the rule of the module's docstring for one 8-bit moment (``want`` the values
    re-quantized, ``got`` what came back); the count of its blocks, and of those bitwise."""
    got, want = got.reshape(-1, BLOCK), want.reshape(-1, BLOCK)
    exact = (got == want).all(dim=1)
    absmax = want.abs().amax(dim=1)
    top_positive = want.amax(dim=1) > -want.amin(dim=1)  # the largest magnitude only a positive value
    assert torch.equal(exact, top_positive), f"{what}: bitwise blocks {exact.tolist()}, blocks topped by a positive value {top_positive.tolist()}"
    worst = float(((got - want).abs().amax(dim=1) / absmax).max())
    assert worst <= ONE_STEP, f"{what}: a block differs by {worst:.4g} of its absmax, over one step of the map ({ONE_STEP:.4g})"
    return exact.numel(), int(exact.sum())


def test_netoptim_8bit_state_continues_in_torchaos_adamw8bit(start_node, eager_torchao):
    nodes = [start_node().address]
    models = [make_model() for _ in range(WORLD)]
    results: dict[int, tuple[dict, dict[str, torch.Tensor]]] = {}
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            model = models[rank]
            # buckets of 8,192: each weight a bucket of its own, its blocks where torchao puts them
            opt = RemoteAdamW(groups(model, named=True), **HYPER, nodes=nodes, rank=rank, world_size=WORLD, bucket_numel=8192, moments="8bit", timeout_s=60)
            for step in range(1, STEPS + 1):
                loss_of(model, *shard(step, rank)).backward()
                opt.step()
                opt.zero_grad()
            results[rank] = (opt.state_dict(), opt.gather_parameters())
            opt.close()
        except BaseException as exc:
            errors.append(exc)

    run_threads(worker, WORLD)
    if errors:
        raise errors[0]
    ours, values = results[0]

    model = make_model()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(values[name])
    torchao_opt = torchao_optim.AdamW8bit(groups(model, named=False), **HYPER, block_size=BLOCK)
    params = [p for group in torchao_opt.param_groups for p in group["params"]]
    converted = to_torchao_8bit(ours, params, block_size=BLOCK)
    torchao_opt.load_state_dict(converted)

    blocks = exact_blocks = 0
    for index, (name, param) in enumerate(in_state_order(model)):
        state = torchao_opt.state[param]
        assert float(state["step"]) == STEPS
        for key in MOMENTS:
            moment, want = state[key], ours["state"][index][key]
            if not quantized_by_torchao(param.numel(), BLOCK):
                assert type(moment) is torch.Tensor and torch.equal(moment, want), f"{name} {key}: fp32 in both, kept bitwise"
                continue
            assert isinstance(moment, OptimState8bit) and moment.signed == (key == "exp_avg") and moment.block_size == BLOCK, f"{name} {key}: {moment!r}"
            if key == "exp_avg_sq":
                assert torch.equal(moment.dequantize(), want), f"{name} {key}: the unsigned map's blocks come back bitwise"
                continue
            total, exact = compare_8bit(moment.dequantize(), want, f"{name} {key}")
            blocks, exact_blocks = blocks + total, exact_blocks + exact
    assert exact_blocks >= MIN_EXACT_BLOCKS * blocks, f"{exact_blocks} of {blocks} exp_avg blocks bitwise"

    # torchao trains on from there: one step, its state advanced and still 8-bit
    before = [p.detach().clone() for p in params]
    loss_of(model, *shard(STEPS + 1, 0)).backward()
    torchao_opt.step()
    for (name, param), old in zip(in_state_order(model), before, strict=True):
        state = torchao_opt.state[param]
        assert float(state["step"]) == STEPS + 1 and torch.isfinite(param).all() and not torch.equal(param, old), name
        assert isinstance(state["exp_avg"], OptimState8bit) == quantized_by_torchao(param.numel(), BLOCK), name


@pytest.mark.parametrize("moments", ["8bit", "fp32"])
def test_torchaos_adamw8bit_state_loads_onto_the_nodes(start_node, eager_torchao, moments):
    model = make_model()
    torchao_opt = torchao_optim.AdamW8bit(groups(model, named=False), **HYPER, block_size=BLOCK)
    for step in range(1, STEPS + 1):
        loss_of(model, *shard(step, 0)).backward()
        torchao_opt.step()
        torchao_opt.zero_grad()
    theirs = torchao_opt.state_dict()  # the live state: what it decodes to, kept before anything else runs
    want = {index: {key: decoded(entry[key]).clone() for key in MOMENTS} for index, entry in theirs["state"].items()}
    assert isinstance(theirs["state"][0]["exp_avg"], OptimState8bit) and torch.is_tensor(theirs["param_groups"][0]["lr"])

    resumed = make_model()
    resumed.load_state_dict(model.state_dict())
    remote = RemoteAdamW(
        groups(resumed, named=True), **HYPER, nodes=[start_node().address], rank=0, world_size=1, bucket_numel=8192, moments=moments, timeout_s=60
    )
    try:
        remote.load_state_dict(theirs)
        ours = remote.state_dict()
        blocks = exact_blocks = 0
        for index, (name, param) in enumerate(in_state_order(resumed)):
            assert float(ours["state"][index]["step"]) == STEPS
            for key in MOMENTS:
                got = ours["state"][index][key]
                if moments == "fp32" or not quantized_by_torchao(param.numel(), BLOCK) or key == "exp_avg_sq":
                    assert torch.equal(got, want[index][key]), f"{moments} moments, {name} {key}: torchao's dequantized values kept bitwise"
                else:
                    total, exact = compare_8bit(got, want[index][key], f"{name} {key}")
                    blocks, exact_blocks = blocks + total, exact_blocks + exact
        assert exact_blocks >= MIN_EXACT_BLOCKS * blocks, f"{exact_blocks} of {blocks} exp_avg blocks bitwise"
        if moments == "fp32":
            back_to_torchao(theirs, ours, in_state_order(resumed))

        # the nodes train on from there, under torchao's param groups (a tensor lr)
        loss_of(resumed, *shard(STEPS + 1, 0)).backward()
        remote.step()
        remote.zero_grad()
        after = remote.state_dict()
        assert all(float(entry["step"]) == STEPS + 1 for entry in after["state"].values())
        assert all(torch.isfinite(p).all() for p in resumed.parameters())
    finally:
        remote.close()


def back_to_torchao(theirs: dict, ours: dict, named: list[tuple[str, nn.Parameter]]) -> None:
    """torchao's state through fp32 moments on the nodes and :func:`to_torchao_8bit` back: codes and
    scales as torchao held them, but in the ``exp_avg`` blocks a negative value tops (their scale now
    the decoded absmax, a few codes moved to a neighbour)."""
    converted = to_torchao_8bit(ours, [param for _, param in named], block_size=BLOCK)
    codes = same_codes = 0
    for index, (name, param) in enumerate(named):
        for key in MOMENTS:
            if not quantized_by_torchao(param.numel(), BLOCK):
                continue
            before, after = theirs["state"][index][key], converted["state"][index][key]
            if key == "exp_avg_sq":
                assert torch.equal(after.codes, before.codes) and torch.equal(after.scale, before.scale), f"{name} {key}"
                continue
            values = before.dequantize().reshape(-1, BLOCK)
            top_positive = values.amax(dim=1) > -values.amin(dim=1)
            assert torch.equal(after.scale == before.scale, top_positive), (
                f"{name} {key}: scales kept exactly where a positive value tops the block, and only there"
            )
            same = after.codes.reshape(-1, BLOCK) == before.codes.reshape(-1, BLOCK)
            assert same[top_positive].all(), f"{name} {key}: a code changed where a positive value tops the block"
            codes, same_codes = codes + same.numel(), same_codes + int(same.sum())
    assert same_codes >= MIN_SAME_CODES * codes, f"{same_codes} of {codes} exp_avg codes as torchao held them"


def test_plain_tensors_are_not_dequantized():
    """Only a subclass with its own ``dequantize`` is decoded: a plain tensor (whose method is for
    torch's quantized dtypes) and a ``Parameter`` come back as they are."""
    plain, param = torch.ones(3), nn.Parameter(torch.ones(3))
    assert plain_tensor(plain) is plain and plain_tensor(param) is param and plain_tensor(2.0) == 2.0
    state = OptimState8bit.zeros((4, 256), signed=True, block_size=BLOCK)
    state.copy_(torch.linspace(-1, 2, 1024).view(4, 256))
    assert type(plain_tensor(state)) is torch.Tensor and torch.equal(plain_tensor(state), state.dequantize())


def test_bad_input_is_refused(monkeypatch):
    param = torch.zeros(64, 64)
    entry = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(64, 64), "exp_avg_sq": torch.zeros(64, 64)}
    good = {"state": {0: entry}, "param_groups": [{"params": [0], "lr": 1e-3}]}
    converted = to_torchao_8bit(good, [param])
    assert isinstance(converted["state"][0]["exp_avg"], OptimState8bit) and converted["param_groups"][0]["lr"].dtype == torch.float32
    assert type(good["state"][0]["exp_avg"]) is torch.Tensor and good["param_groups"][0]["lr"] == 1e-3  # the given dict unchanged
    with pytest.raises(TypeError, match="must be an optimizer's state dict"):
        to_torchao_8bit([good], [param])
    with pytest.raises(TypeError, match="block_size must be an int"):
        to_torchao_8bit(good, [param], block_size=256.0)
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        to_torchao_8bit(good, [param], block_size=0)
    with pytest.raises(ValueError, match="has no 'state' and 'param_groups'"):
        to_torchao_8bit({"state": {}}, [param])
    with pytest.raises(ValueError, match="hold 1 parameters, params has 2"):
        to_torchao_8bit(good, [param, param])
    with pytest.raises(ValueError, match=r"exp_avg of parameter 0 has shape \(64, 64\), the parameter \(4096,\)"):
        to_torchao_8bit(good, [torch.zeros(4096)])
    lion = {**good, "state": {0: {"step": entry["step"], "exp_avg": entry["exp_avg"]}}}
    with pytest.raises(ValueError, match=r"has no \['exp_avg_sq'\]: is it a state dict of AdamW or Adam\?"):
        to_torchao_8bit(lion, [param])
    monkeypatch.setitem(sys.modules, "torchao.optim.subclass_8bit", None)  # as if torchao were not installed
    with pytest.raises(ImportError, match=r"needs the package 'torchao', which is not installed: pip install 'netoptim-train\[integrations\]'"):
        to_torchao_8bit(good, [param])
