"""The box's limits for an offloaded step, measured in the run of ``netoptim bench gpu``: pinned
host-device bandwidth each way, pageable host-to-device bandwidth, and torch's fused CPU AdamW at all
cores (with the node's own update pass at its threads beside it). With the GPU's forward and backward alone they bound any offloaded step from below."""

from __future__ import annotations

import os

import torch

from gpu_worker.layerwise.copy_rates import median_seconds


def cpu_adamw_mparams(numel: int = 1 << 26, threads: int | None = None, repeats: int = 5) -> dict[str, float]:
    """Million parameters a second through ``torch.optim.AdamW(fused=True)`` on the CPU, all cores."""
    threads = threads or os.cpu_count() or 1
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        param = torch.zeros(numel, requires_grad=True)
        param.grad = torch.randn(numel)
        opt = torch.optim.AdamW([param], lr=1e-4, fused=True)
        seconds = median_seconds(opt.step, repeats, lambda: None)
    finally:
        torch.set_num_threads(previous)
    return {"cpu_adamw_mparams_per_s": numel / 1e6 / seconds, "cpu_adamw_threads": threads}


def node_update_mparams(threads: int, numel: int = 1 << 26, bucket_numel: int = 1 << 20) -> dict[str, float]:
    """The node's update pass (one gradient term, ``bucket_numel``-element buckets, at most ``numel``) on
    ``threads`` threads, Mparam/s: its compiled loop and torch ops, the two paths a node can take (which
    is faster depends on the cores)."""
    from optimizer_node.update.profile import update_pass_seconds_per_param

    bucket_numel = min(bucket_numel, numel)
    rates = {
        f"node_update_{path}_mparams_per_s": 1e-6
        / update_pass_seconds_per_param(1, threads, numel=numel, repeats=3, compiled=path == "compiled", bucket_numel=bucket_numel)
        for path in ("compiled", "torch_ops")
    }
    # as an fp32 job's node runs it with same-host workers: the master values on the parameter board, each
    # pass reading one slot and writing the other; the old way (updated in place, then copied onto the
    # board: one more stream of 4 bytes a parameter) for comparison; and with each push checked for NaN/inf first
    board = update_pass_seconds_per_param(1, threads, numel=numel, repeats=3, board=True, bucket_numel=bucket_numel)
    board_copy = update_pass_seconds_per_param(1, threads, numel=numel, repeats=3, board=True, board_copy=True, bucket_numel=bucket_numel)
    checked = update_pass_seconds_per_param(1, threads, numel=numel, repeats=3, board=True, check=True, bucket_numel=bucket_numel)
    return rates | {
        "node_update_compiled_board_mparams_per_s": 1e-6 / board,
        "node_update_compiled_board_copy_mparams_per_s": 1e-6 / board_copy,
        "node_update_compiled_checked_board_mparams_per_s": 1e-6 / checked,
        "node_update_threads": threads,
        "node_update_bucket_numel": bucket_numel,
    }


def offload_limit_step_s(params: int, wire_bytes_per_param: int, compute_step_s: float, limits: dict) -> dict[str, float]:
    """The fastest an offloaded step can be on this box: every part overlapped with the others, so
    the slowest of GPU compute, gradients down, parameters up and the CPU update sets the pace."""
    parts = {
        "gpu_compute_s": compute_step_s,
        "d2h_s": params * wire_bytes_per_param / 1e9 / limits["pinned_d2h_gbs"],
        "h2d_s": params * wire_bytes_per_param / 1e9 / limits["pinned_h2d_gbs"],
        "cpu_adamw_s": params / 1e6 / limits["cpu_adamw_mparams_per_s"],
    }
    return parts | {"offload_limit_step_s": max(parts.values())}
