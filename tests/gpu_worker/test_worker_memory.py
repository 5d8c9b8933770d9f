"""A CPU worker's resident size stays flat from step to step, layer-wise or full model: the heap it
does not trim between steps is served again to the next step's allocations, not grown. Run in a
process of its own, so that its RSS is the worker's alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROGRAM = r"""
import json, sys
import torch
from gpu_worker import RemoteAdamW
from gpu_worker import offload
from gpu_worker.models import GPT, GPTConfig, gpt_initializer
from transport.host_memory import resident_bytes

config = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=256)
torch.manual_seed(0)
options = dict(nodes=[sys.argv[1]], rank=0, world_size=1, lr=1e-4, timeout_s=60)
if sys.argv[3] == "layerwise":
    with torch.device("meta"):
        model = GPT(config)
    opt = offload(model, model.blocks, init_fn=gpt_initializer(config), **options)
else:
    model = GPT(config)
    opt = RemoteAdamW(model.named_parameters(), **options)
rss = []
for step in range(int(sys.argv[2])):
    data = torch.randint(0, config.vocab_size, (8, config.block_size + 1), generator=torch.Generator().manual_seed(step))
    _logits, loss = model(data[:, :-1].contiguous(), data[:, 1:].contiguous())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    rss.append(resident_bytes())
opt.close()
print(json.dumps(rss))
"""

STEPS = 24
WARMUP = 6


@pytest.mark.parametrize("mode", ["layerwise", "full"])
def test_a_cpu_worker_s_resident_size_stays_flat_over_steps(node, mode):
    done = subprocess.run([sys.executable, "-c", PROGRAM, node.address, str(STEPS), mode], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    settled = max(rss[WARMUP - 2 : WARMUP])
    grown = max(rss[WARMUP:]) - settled
    # StepHeap lets the heap drift by 32 MiB or an eighth before it trims (glibc's free lists drift a few MiB
    # in 20 steps of the full model); a step's gradients kept by mistake would be 13 MB a step here
    assert grown <= 32 << 20, f"the worker's RSS grew by {grown / 2**20:.1f} MiB after warm-up: {[round(r / 2**20) for r in rss]} MiB"
