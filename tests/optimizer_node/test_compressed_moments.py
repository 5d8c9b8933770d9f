"""Moments kept in bf16 or 8 bits on the nodes: two workers, two real nodes (in memory and out of
core), AdamW, Adam and Lion (and SGD's momentum in bf16), bitwise equal to a one-process reference built from torchao's own
quantization functions (its dynamic map, block scales and rounding) with the update in the node's
order: the moments decoded, torch's fused kernel (or Lion's formula) in fp32, the moments encoded.
Tensors under 4,096 elements, or not a whole number of blocks, stay fp32, as in torchao."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("torchao", reason="the oracle is built from torchao's quantization functions: pip install 'netoptim-train[test]'")
from torchao.optim.quant_utils import create_dynamic_map, dequant_with_qmap, quantize_8bit_with_qmap, scale_tensor

from gpu_worker import NodeError, RemoteAdam, RemoteAdamW, RemoteLion, RemoteSGD
from tests.gpu_worker.harness import run_threads

WORLD = 2
STEPS = 6
BLOCK = 256
HYPER = {"lr": 3e-3, "weight_decay": 0.01}


def make_model() -> nn.Module:
    """Weights of 8,192 (compressed), 8,192 (compressed) and 6,400 elements (bf16: compressed; 8 bits:
    not whole blocks, fp32), small biases (fp32)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 32), nn.Tanh(), nn.Linear(32, 200))


def groups(model: nn.Module, named: bool) -> list[dict]:
    pick = (lambda n, p: (n, p)) if named else (lambda n, p: p)
    weights = [pick(n, p) for n, p in model.named_parameters() if p.dim() == 2]
    biases = [pick(n, p) for n, p in model.named_parameters() if p.dim() == 1]
    return [{"params": weights}, {"params": biases, "weight_decay": 0.0}]


def shard(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 32, generator=generator), torch.randn(4, 200, generator=generator)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


class ReferenceMoment:
    """One parameter's moment as torchao stores it: 8-bit codes and block scales, bf16, or fp32."""

    def __init__(self, numel: int, moments: str, signed: bool) -> None:
        self.signed = signed
        compressed = numel >= 4096 and numel % (BLOCK if moments == "8bit" else 64) == 0
        self.kind = moments if compressed else "fp32"
        if self.kind == "8bit":
            self.qmap = torch.tensor(create_dynamic_map(signed=signed), dtype=torch.float32)
            self.codes = torch.zeros(numel, dtype=torch.uint8)
            self.scale = torch.zeros(numel // BLOCK)
        else:
            self.values = torch.zeros(numel, dtype=torch.bfloat16 if self.kind == "bf16" else torch.float32)

    def read(self) -> torch.Tensor:
        if self.kind == "8bit":
            return dequant_with_qmap(self.codes, self.qmap, self.scale)
        return self.values.to(torch.float32).clone()

    def write(self, values: torch.Tensor) -> None:
        if self.kind == "8bit":
            scaled, self.scale = scale_tensor(values, BLOCK)
            self.codes = quantize_8bit_with_qmap(scaled, self.qmap)
        else:
            self.values.copy_(values)


def reference(rule: str, moments: str) -> list[torch.Tensor]:
    model = make_model()
    params = list(model.parameters())
    decay = [HYPER["weight_decay"] if p.dim() == 2 else 0.0 for p in params]
    first = [ReferenceMoment(p.numel(), moments, True) for p in params]
    second = [ReferenceMoment(p.numel(), moments, False) for p in params]
    beta1, beta2 = (0.9, 0.99) if rule == "lion" else (0.9, 0.999)
    for step in range(1, STEPS + 1):
        grads = []
        for rank in range(WORLD):
            replica = copy.deepcopy(model)
            loss_of(replica, *shard(step, rank)).backward()
            grads.append([p.grad for p in replica.parameters()])
        with torch.no_grad():
            for i, p in enumerate(params):
                grad = (grads[0][i] + grads[1][i]) / WORLD
                flat = p.view(-1)
                m, v = first[i].read(), second[i].read()
                if rule == "sgd":
                    torch._fused_sgd_(
                        [flat], [grad.view(-1).clone()], [m], weight_decay=decay[i], momentum=0.9, lr=HYPER["lr"], dampening=0.0,
                        nesterov=False, maximize=False, is_first_step=step == 1, grad_scale=None, found_inf=None,
                    )  # fmt: skip
                elif rule == "lion":
                    direction = m.mul(beta1).add_(grad.view(-1), alpha=1 - beta1).sign_()
                    flat.mul_(1 - HYPER["lr"] * decay[i])
                    flat.add_(direction, alpha=-HYPER["lr"])
                    m.mul_(beta2).add_(grad.view(-1), alpha=1 - beta2)
                else:
                    kernel = torch._fused_adamw_ if rule == "adamw" else torch._fused_adam_
                    kernel(
                        [flat], [grad.view(-1).clone()], [m], [v], [], [torch.tensor(float(step))],
                        lr=HYPER["lr"], beta1=beta1, beta2=beta2, weight_decay=decay[i], eps=1e-8,
                        amsgrad=False, maximize=False, grad_scale=None, found_inf=None,
                    )  # fmt: skip
                first[i].write(m)
                if rule not in ("lion", "sgd"):
                    second[i].write(v)
    return [p.detach().clone() for p in params]


OPTIMIZERS = {"adamw": RemoteAdamW, "adam": RemoteAdam, "lion": RemoteLion, "sgd": RemoteSGD}


def offloaded(rule: str, moments: str, nodes: list[str], inspect=None) -> list[torch.Tensor]:
    models = [make_model() for _ in range(WORLD)]
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            model = models[rank]
            extra = {"lion": {"betas": (0.9, 0.99)}, "sgd": {"momentum": 0.9}}.get(rule, {})
            opt = OPTIMIZERS[rule](
                groups(model, named=True), **HYPER, **extra, nodes=nodes, rank=rank, world_size=WORLD,
                bucket_numel=8192, moments=moments, timeout_s=60,
            )  # fmt: skip
            for step in range(1, STEPS + 1):
                loss_of(model, *shard(step, rank)).backward()
                opt.step()
                opt.zero_grad()
            values = opt.gather_parameters()
            results[rank] = [values[name] for name, _ in model.named_parameters()]
            if inspect is not None:
                inspect(rank, opt)
            opt.close()
        except BaseException as exc:
            errors.append(exc)

    run_threads(worker, WORLD)
    if errors:
        raise errors[0]
    return results[0]


def assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a.view(-1), b.view(-1)), f"{what}: parameter {index} differs by {float((a.view(-1) - b.view(-1)).abs().max()):.3g}"


@pytest.mark.parametrize(
    ("rule", "moments"), [("adamw", "8bit"), ("adamw", "bf16"), ("adam", "8bit"), ("adam", "bf16"), ("lion", "8bit"), ("lion", "bf16"), ("sgd", "bf16")]
)
def test_compressed_moments_are_bitwise_the_reference(start_node, rule, moments):
    nodes = [start_node(f"node{i}").address for i in range(2)]
    assert_bitwise(offloaded(rule, moments, nodes), reference(rule, moments), f"{rule}, {moments} moments")


@pytest.mark.parametrize("moments", ["8bit", "bf16"])
def test_out_of_core_compressed_moments_are_bitwise_the_reference(start_node, tmp_path, moments):
    """A budget smaller than the job's state: buckets go to disk and back, their moments compressed."""
    nodes = [start_node(f"node{i}", extra_args=("--state-dir", str(tmp_path / f"state{i}"), "--memory-budget", "128KiB")).address for i in range(2)]
    assert_bitwise(offloaded("adamw", moments, nodes), reference("adamw", moments), f"out of core, {moments} moments")


def test_fp32_moments_stay_torch_and_the_state_dict_is_torchs_format(start_node):
    """fp32 moments are torch's AdamW bitwise; with 8-bit moments the state dict is torch's layout,
    its moments the decoded values (within the 8-bit rounding of fp32's)."""
    nodes = [start_node(f"node{i}").address for i in range(2)]
    assert_bitwise(offloaded("adamw", "fp32", nodes), reference("adamw", "fp32"), "fp32 moments")
    states: dict[int, dict] = {}
    offloaded("adamw", "8bit", nodes, inspect=lambda rank, opt: states.setdefault(rank, opt.state_dict()))
    entry = states[0]["state"][0]  # the first weight: 8,192 elements, compressed
    assert set(entry) == {"step", "exp_avg", "exp_avg_sq"} and entry["exp_avg"].dtype == torch.float32
    assert entry["exp_avg"].shape == (256, 32) and float(entry["step"]) == STEPS
    assert entry["exp_avg_sq"].min() >= 0 and entry["exp_avg"].abs().max() > 0


def test_a_worker_whose_moments_differ_is_refused(start_node):
    node = start_node().address
    model = make_model()
    first = RemoteAdamW(groups(model, named=True), nodes=[node], rank=0, world_size=2, bucket_numel=8192, moments="8bit", timeout_s=30)
    try:
        with pytest.raises(NodeError, match=r"LAYOUT_MISMATCH.*moments differs \(this worker has 'fp32'\)"):
            RemoteAdamW(groups(make_model(), named=True), nodes=[node], rank=1, world_size=2, bucket_numel=8192, timeout_s=30)
    finally:
        first.close()


def test_bad_moment_options_are_refused_before_any_node_hears_of_them():
    params = [nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError, match="moments 'int4' is not one of"):
        RemoteAdamW(params, nodes=["tcp://127.0.0.1:1"], moments="int4")
    with pytest.raises(ValueError, match="moment_block must be one of"):
        RemoteAdamW(params, nodes=["tcp://127.0.0.1:1"], moments="8bit", moment_block=100)
    with pytest.raises(ValueError, match="SGD's momentum can be kept in bf16, not in 8 bits"):
        RemoteSGD(params, lr=0.1, momentum=0.9, nodes=["tcp://127.0.0.1:1"], moments="8bit")
