"""``netoptim demo``: a small GPT trained by local node(s) and worker processes."""

from __future__ import annotations

import argparse
import sys
import tempfile

from netoptim.launch.niceness import SHARED_CORES_NICENESS
from netoptim.launch.processes import NodeProcess, run_workers


def run_demo(args: argparse.Namespace) -> int:
    """``netoptim demo``: local node(s) and worker processes training a small GPT."""
    with tempfile.TemporaryDirectory(prefix="netoptim-demo-") as workdir:
        nodes = [NodeProcess(workdir, name=f"node{i}", log_level="WARNING", nice=SHARED_CORES_NICENESS) for i in range(args.nodes)]
        try:
            for node in nodes:
                node.start()
            addresses = ",".join(node.address for node in nodes)
            mode = "layer-wise" if args.layerwise else "full-model"
            print(f"netoptim demo: {args.nodes} optimizer node(s) at {addresses}, {args.workers} {mode} worker process(es), {args.steps} steps", flush=True)
            script = ["--nodes", addresses, "--steps", str(args.steps), "--wire-dtype", args.wire_dtype, "--seed", str(args.seed), "--moments", args.moments]
            status = run_workers([*script, "--layerwise"] if args.layerwise else script, args.workers)
        finally:
            for node in nodes:
                node.stop()
        if status != 0:
            for node in nodes:
                sys.stderr.write(node.log_text()[-4000:])
        return status
