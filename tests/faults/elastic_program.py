"""A member of an elastic job, as a process: the preemption drill's worker.

It trains the model and data of ``netoptim.benchmarks.morph_bench`` against a node, its membership agreed
through a TCPStore (:mod:`gpu_worker.elastic`); SIGTERM makes it leave at the next agreed boundary
(preemption with notice), exit 0. It writes ``OUT/NAME.json``: each step it trained, at which width
and as which rank, and (whoever is rank 0 at the end) ``OUT/final.pt``: the parameters."""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path

import torch

from gpu_worker import RemoteAdamW
from gpu_worker.elastic import ElasticGroup, shard
from netoptim.benchmarks.morph_bench import GLOBAL_BATCH, LR, WEIGHT_DECAY, loss_of, make_model, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--node", required=True)
    parser.add_argument("--store", required=True, help="HOST:PORT of the TCPStore the test hosts")
    parser.add_argument("--name", required=True)
    parser.add_argument("--join", action="store_true", help="join the running job once the test sets drill/join in the store")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds of extra work in each step (inside it)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    host, port = args.store.rsplit(":", 1)
    store = torch.distributed.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    group = ElasticGroup(store, args.name, timeout_s=60)
    group.leave_on()  # SIGTERM: preempted with notice
    if args.join:  # started early (imports take seconds), joins when told
        store.wait(["drill/join"], timedelta(seconds=60))
    first = group.join() if args.join else group.start()
    model = make_model()
    options = {"join_at_step": first.at_step} if args.join else {}
    opt = RemoteAdamW(
        model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, nodes=[args.node], rank=first.rank, world_size=first.world_size, timeout_s=60, **options
    )
    trained: dict[int, list[int]] = {}
    step = opt.remote_step
    while step < args.steps:
        change = group.at_boundary(step)
        if change is not None:
            if change.leaving:
                break
            opt.morph(change.rank, change.world_size, change.at_step)
        x, y = samples(shard(step, GLOBAL_BATCH, opt.rank, opt.world_size))
        loss_of(model, x, y).backward()
        time.sleep(args.step_delay)  # stands for the rest of a real step's compute
        opt.step()
        opt.zero_grad()
        trained[step] = [opt.rank, opt.world_size]
        store.set("drill/progress", str(step + 1))
        step += 1
    if step == args.steps and opt.rank == 0:
        torch.save([p.detach() for p in model.parameters()], Path(args.out) / "final.pt")
    opt.close()
    (Path(args.out) / f"{args.name}.json").write_text(json.dumps({"steps": trained, "left_at": step if step < args.steps else None}))


if __name__ == "__main__":
    main()
