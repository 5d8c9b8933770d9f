"""The correctness oracle: offloaded training against torch.optim.AdamW in one process."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.gpu_worker.harness import RunConfig, max_difference, reference_averaged, reference_whole_batch, run_offloaded
from tests.transport.availability import requires_mooncake

log = logging.getLogger(__name__)


@pytest.mark.parametrize(
    ("world_size", "num_nodes", "max_grad_norm", "early_push", "layerwise", "overlap"),
    [
        (2, 1, None, False, False, False),
        (2, 2, None, True, False, False),
        (4, 1, None, False, False, False),
        (2, 1, 0.05, False, False, False),
        (4, 2, 0.05, True, False, False),
        (2, 2, None, True, True, False),
        (2, 1, 0.05, True, True, False),
        (2, 2, None, True, False, True),
        (4, 2, 0.05, False, False, True),
    ],
    ids=[
        "2w-1n",
        "2w-2n-early-push",
        "4w-1n",
        "2w-1n-clip",
        "4w-2n-clip-early-push",
        "2w-2n-layerwise",
        "2w-1n-clip-layerwise",
        "2w-2n-early-push-overlap-forward",
        "4w-2n-clip-overlap-forward",
    ],
)
def test_matches_adamw_fed_the_averaged_gradients(start_node, world_size, num_nodes, max_grad_norm, early_push, layerwise, overlap):
    nodes = [start_node(f"node{i}").address for i in range(num_nodes)]
    config = RunConfig(
        world_size=world_size,
        nodes=nodes,
        max_grad_norm=max_grad_norm,
        extra={} if layerwise else {"push_during_backward": early_push},
        layerwise=layerwise,
        overlap_forward=overlap,
    )
    params, norms = run_offloaded(config)

    fused_ref, ref_norms = reference_averaged(world_size, fused=True, max_grad_norm=max_grad_norm)
    default_ref, _ = reference_averaged(world_size, fused=False, max_grad_norm=max_grad_norm)
    whole_batch = reference_whole_batch(max_grad_norm=max_grad_norm)
    diff_fused, diff_default, diff_whole = max_difference(params, fused_ref), max_difference(params, default_ref), max_difference(params, whole_batch)
    log.info("max |diff|: vs fused AdamW %.3g, vs default AdamW %.3g, vs whole batch %.3g", diff_fused, diff_default, diff_whole)
    print(
        f"\n{world_size} workers, {num_nodes} nodes, clip {max_grad_norm}, layer-wise {layerwise}: vs fused AdamW {diff_fused:.3g}, vs default AdamW {diff_default:.3g}, vs whole batch {diff_whole:.3g}"
    )

    if max_grad_norm is None:
        assert diff_fused == 0.0, "the node runs torch's fused AdamW kernel on the same averaged gradient: it must be bitwise equal"
    else:
        # The global norm is summed in another order than torch's, so the clip factor may differ in its last bit.
        assert diff_fused <= 1e-6
        assert norms == pytest.approx(ref_norms, rel=1e-6)
        assert all(n is not None and n > max_grad_norm for n in norms[:3]), "the test must actually clip"
    assert diff_default <= 1e-6
    assert diff_whole <= 1e-5


def test_paced_pushes_match_adamw_fed_the_averaged_gradients(start_node):
    """A push window of one bucket: every push after the first of a step waits for values to come back
    (kept until step() installs them); the result is bitwise the same."""
    nodes = [start_node(f"paced{i}").address for i in range(2)]
    pacers = []
    config = RunConfig(
        world_size=4,
        nodes=nodes,
        extra={"push_during_backward": True, "pace_window_bytes": 300 * 4},
        inspect=lambda _rank, opt: pacers.append(opt._session.pacer),
    )
    params, _ = run_offloaded(config)
    assert sum(p.waits for p in pacers) > 0 and sum(p.kept_total for p in pacers) > 0, "the window must have held pushes back and kept values"
    fused_ref, _ = reference_averaged(4, fused=True)
    assert max_difference(params, fused_ref) == 0.0
    with pytest.raises(ValueError, match="cannot go with max_grad_norm"):
        run_offloaded(RunConfig(world_size=1, nodes=nodes[:1], max_grad_norm=1.0, extra={"push_during_backward": True, "pace_window_bytes": 1200}))


@pytest.mark.parametrize("wire_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_wire_converges_like_fp32(start_node, wire_dtype):
    """bf16/fp16 gradients and parameters on the wire, fp32 master on the node: within 2e-2 of the fp32
    run (bf16 keeps 8 bits of mantissa; parameters here are O(0.1-1), so one rounding is ~4e-3)."""
    node_fp32, node_half = start_node("fp32").address, start_node("half").address
    fp32, _ = run_offloaded(RunConfig(nodes=[node_fp32]))
    bf16, _ = run_offloaded(RunConfig(nodes=[node_half], wire_dtype=wire_dtype))
    assert all(p.dtype == torch.float32 for p in bf16)
    assert max_difference(fp32, bf16) <= 2e-2
    assert max_difference(fp32, bf16) > 0.0  # it really went through bf16


@pytest.mark.parametrize(
    "transport",
    ["ipc", "tcp-curve", "tcp-3-lanes", pytest.param("mooncake", marks=requires_mooncake), pytest.param("mooncake-layerwise-clip", marks=requires_mooncake)],
)
def test_oracle_holds_over_every_transport(start_node, tmp_path, transport):
    extra: dict = {}
    if transport.startswith("mooncake"):  # two nodes, so each worker holds two engine connections
        nodes = [start_node(f"mc{i}", listen="mooncake://127.0.0.1:0").address for i in range(2)]
        assert all(address.startswith("mooncake://") for address in nodes)
        clip = 0.05 if transport.endswith("clip") else None
        params, _ = run_offloaded(RunConfig(nodes=nodes, layerwise="layerwise" in transport, max_grad_norm=clip))
        fused_ref, _ = reference_averaged(2, fused=True, max_grad_norm=clip)
        assert max_difference(params, fused_ref) <= (0.0 if clip is None else 1e-6)
        return
    if transport == "tcp-3-lanes":  # three TCP connections per worker and node, buckets spread over them
        nodes = [start_node(f"lanes{i}", extra_args=("--io-threads", "3")).address for i in range(2)]
        params, _ = run_offloaded(RunConfig(nodes=nodes, extra={"connections_per_node": 3, "same_host_ipc": False}))
        assert max_difference(params, reference_averaged(2, fused=True)[0]) == 0.0
        return
    if transport == "ipc":
        node = start_node(listen=f"ipc://{tmp_path}/node.sock")
    else:
        from transport.zeromq.security import generate_keypair

        node_public, node_secret = generate_keypair(str(tmp_path / "keys"), "node")
        _, worker_secret = generate_keypair(str(tmp_path / "allowed"), "worker")
        node = start_node(extra_args=("--curve-secret-key", str(node_secret), "--curve-allow", str(tmp_path / "allowed")))
        extra = {"curve_secret_key": str(worker_secret), "curve_server_key": str(node_public)}
    params, _ = run_offloaded(RunConfig(nodes=[node.address], extra=extra))
    fused_ref, _ = reference_averaged(2, fused=True)
    assert max_difference(params, fused_ref) == 0.0


@pytest.mark.parametrize(
    ("layerwise", "clip", "wire", "sync"),
    [
        # full mode over an out-of-core node also trains bitwise in test_recovery.py's out-of-core crash case
        pytest.param(False, None, "float32", False, marks=pytest.mark.slow),
        (True, None, "float32", False),
        (True, None, "float32", True),  # --sync-state-writes: each next version overwrites the retired one's file; 3 I/O threads each way
        pytest.param(False, 0.05, "float32", False, marks=pytest.mark.slow),
        pytest.param(False, None, "bfloat16", False, marks=pytest.mark.slow),
    ],
)
def test_out_of_core_nodes_train_bitwise_like_in_memory_nodes(start_node, tmp_path, layerwise, clip, wire, sync):
    """A budget of two buckets forces every bucket through its state file at every step."""
    wire_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[wire]
    storage = ("--memory-budget", str(2 * 300 * 12)) + (("--sync-state-writes", "--state-io-threads", "3") if sync else ())
    processes = [start_node(f"ooc{i}", extra_args=("--state-dir", str(tmp_path / f"state{i}"), *storage)) for i in range(2)]
    nodes = [process.address for process in processes]
    assert all(f"{3 if sync else 2} I/O threads" in process.log_text() for process in processes)
    config = RunConfig(nodes=nodes, layerwise=layerwise, max_grad_norm=clip, wire_dtype=wire_dtype, steps=8)
    out_of_core, _ = run_offloaded(config)
    in_memory, _ = run_offloaded(
        RunConfig(nodes=[start_node("mem0").address, start_node("mem1").address], layerwise=layerwise, max_grad_norm=clip, wire_dtype=wire_dtype, steps=8)
    )
    assert max_difference(out_of_core, in_memory) == 0.0
    if clip is None and wire == "float32":
        assert max_difference(out_of_core, reference_averaged(2, fused=True, steps=8)[0]) == 0.0
    assert len(list((tmp_path / "state0").glob("bucket-*.bin"))) > 2, "the state lives in files"


def test_nodes_weighted_by_bandwidth_hold_shares_in_proportion_and_stay_bitwise(start_node):
    """node_bandwidths: a node with a link three times as fast holds about three times the buckets."""
    nodes = [start_node(f"node{i}").address for i in range(2)]
    owned: dict[int, list[int]] = {}

    def inspect(rank: int, opt) -> None:
        if rank == 0:
            for bucket in opt._session.buckets:
                owned.setdefault(bucket.node, []).append(bucket.numel)

    config = RunConfig(world_size=2, nodes=nodes, bucket_numel=128, extra={"node_bandwidths": [30.0, 10.0]}, inspect=inspect)
    params, _ = run_offloaded(config)
    assert max_difference(params, reference_averaged(2, fused=True)[0]) == 0.0
    share = sum(owned[0]) / (sum(owned[0]) + sum(owned[1]))
    assert 0.65 <= share <= 0.85, share


@pytest.mark.parametrize(
    ("world_size", "num_nodes", "layerwise", "wire_dtype"),
    [(2, 1, False, torch.float32), (4, 2, False, torch.float32), (2, 2, True, torch.float32), (2, 1, False, torch.bfloat16)],
    ids=["2w-1n", "4w-2n", "2w-2n-layerwise", "2w-1n-bf16"],
)
def test_update_passes_on_their_own_thread_train_bitwise_as_on_the_loop(start_node, world_size, num_nodes, layerwise, wire_dtype):
    """``--pass-thread``: the passes run on a thread of their own while the loop takes pushes and
    pulls and sends values; the run is bitwise torch's fused AdamW (fp32), and bitwise the run with
    the passes on the loop's thread (bf16 wire)."""
    runs = []
    for flags in (("--pass-thread",), ()) if wire_dtype != torch.float32 else (("--pass-thread",),):
        nodes = [start_node(f"node{i}{'-pt' if flags else ''}", extra_args=flags).address for i in range(num_nodes)]
        extra = {} if layerwise else {"push_during_backward": True}
        runs.append(run_offloaded(RunConfig(world_size=world_size, nodes=nodes, wire_dtype=wire_dtype, layerwise=layerwise, extra=extra))[0])
    if wire_dtype == torch.float32:
        assert max_difference(runs[0], reference_averaged(world_size, fused=True)[0]) == 0.0
    else:
        assert max_difference(runs[0], runs[1]) == 0.0
