"""A device is the same device however it is spelled: ``cuda`` and ``cuda:0``, ``cpu`` and ``cpu:0``."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.layerwise.device_copy import canonical_device
from gpu_worker.layerwise.units import plan_units
from gpu_worker.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def test_spellings_of_the_cpu_are_one_device():
    assert canonical_device("cpu:0") == canonical_device("cpu") == canonical_device(torch.device("cpu")) == torch.ones(1).device


@pytest.mark.parametrize("spelling", ["cpu", "cpu:0", torch.device("cpu", 0)])
def test_a_meta_model_is_materialized_on_any_spelling_of_the_cpu(spelling):
    with torch.device("meta"):
        model = GPT(CONFIG)
    plan = plan_units(model, model.blocks, device=spelling, init_fn=lambda name, tensor: tensor.zero_())
    assert plan.device == torch.device("cpu") and all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spelling", ["cuda", f"cuda:{torch.cuda.current_device() if torch.cuda.is_available() else 0}"])
def test_a_meta_model_is_materialized_on_any_spelling_of_the_gpu(spelling):
    with torch.device("meta"):
        model = GPT(CONFIG)
    plan = plan_units(model, model.blocks, device=torch.device(spelling), init_fn=lambda name, tensor: tensor.zero_())
    assert plan.device == canonical_device("cuda") and all(p.device == plan.device for p in model.parameters())
