"""After warm-up a step allocates no tensor memory, on the worker (``step()``) or on the node: every
buffer is made once and reused. Counted with a torch dispatch mode, which sees every tensor op of the
thread it is entered on: an op that is neither a view nor writes into a given tensor (in place, or an
``out=``) and returns storage not seen before is an allocation. (The transport's received frames are
ZeroMQ's memory, viewed by the tensors, not torch allocations.)"""

from __future__ import annotations

import collections
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_worker import RemoteAdamW
from optimizer_node.config import NodeConfig
from optimizer_node.daemon import NodeDaemon
from tests.gpu_worker.harness import loss_fn, make_model, shard

WARMUP, STEPS = 4, 10


class CountAllocations(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.allocations: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        if not func.is_view and not func._schema.is_mutable:
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.numel() > 0:
                    self.allocations[str(func)] += 1
        return out


def test_a_step_after_warm_up_allocates_nothing_on_the_worker_or_the_node():
    node = NodeDaemon(NodeConfig(same_host_ipc=False))
    stop = threading.Event()
    serving = threading.Thread(target=node.serve, args=(stop,))
    serving.start()
    worker, on_node = CountAllocations(), CountAllocations()
    try:
        model = make_model()
        opt = RemoteAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, nodes=[node.address], rank=0, world_size=1, bucket_numel=128)
        for step in range(STEPS):
            loss_fn(model, *shard(step, 0, 1)).backward()
            if step == WARMUP:
                node.commands.call(on_node.__enter__)  # on the node's own thread
            if step >= WARMUP:
                with worker:
                    opt.step()
            else:
                opt.step()
            opt.zero_grad(set_to_none=False)
        node.commands.call(lambda: on_node.__exit__(None, None, None))
        opt.close()
    finally:
        stop.set()
        serving.join(30)
    assert not worker.allocations, dict(worker.allocations)
    assert not on_node.allocations, dict(on_node.allocations)
