"""``netoptim bench cluster``: netoptim against torch FSDP and DDP on the same emulated cluster.

One run builds one emulated cluster (``netoptim/cluster/``: hosts as network namespaces, links shaped with
``tc`` at the target's rate scaled by this CPU's speed) and trains the same GPT, with the same global
batch and the same links, three times: netoptim (workers push gradients to the node hosts), FSDP
(full shard over gloo among the workers, rendezvous on worker host 0) and DDP (gloo). ``ratio`` is
netoptim's tokens/s over FSDP's; the bytes every link carried per step sit next to the model of
docs/cluster.md. Needs root.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

log = logging.getLogger(__name__)

SYSTEMS = ("netoptim", "fsdp", "ddp")


def run(args: argparse.Namespace) -> dict:
    """The benchmark's report (exits 1 with a message when not root)."""
    if os.geteuid() != 0:
        print("netoptim bench cluster: needs root (it creates network namespaces, veths, a bridge and tc qdiscs); run it with sudo", file=sys.stderr)
        raise SystemExit(1)
    from netoptim.cli.cluster import cluster_run_from_args
    from netoptim.cluster.session import run_cluster

    report = run_cluster(cluster_run_from_args(args, SYSTEMS))
    tokens = {system: report["results"][system]["tokens_per_s"] for system in SYSTEMS}
    return {
        "benchmark": "cluster",
        **report,
        **{f"{system}_tokens_per_s": value for system, value in tokens.items()},
        "ratio": tokens["netoptim"] / tokens["fsdp"],
        "netoptim_over_ddp": tokens["netoptim"] / tokens["ddp"],
        # the step-time model of planning.cluster_model against the measured steps
        "prediction_errors": {system: report["results"][system]["prediction_error"] for system in SYSTEMS},
    }
