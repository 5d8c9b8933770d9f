"""RemoteAdamW against torch + DDP, in real processes over gloo: parameters that get no gradient (on
every rank, on one rank), frozen layers unfrozen mid-run, BatchNorm buffers, the no-decay param
groups with a scheduler per group. fp32 on the wire: every value must be equal bit for bit."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from netoptim.launch.processes import NodeProcess
from tests.gpu_worker import ddp_programs
from tests.gpu_worker.ddp_programs import SCENARIOS

DEADLINE_S = 180


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[tuple[str, str], list[dict[str, torch.Tensor]]]:
    """Every scenario run once by torch and once by netoptim (one node each), in one pair of processes."""
    root = tmp_path_factory.mktemp("semantics")
    nodes = {name: NodeProcess(root, name=f"node-{name}").start() for name in SCENARIOS}
    runs = []
    store = dist.TCPStore("127.0.0.1", 0, ddp_programs.WORLD_SIZE + 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    try:
        for name in SCENARIOS:
            for system in ("torch", "netoptim"):
                runs.append((name, system, str(root / f"{name}-{system}.init"), nodes[name].address, str(root / f"{name}-{system}-{{rank}}.pt")))
        context = mp.start_processes(ddp_programs.main, args=(store.port, runs), nprocs=ddp_programs.WORLD_SIZE, start_method="spawn", join=False)
        deadline = time.monotonic() + DEADLINE_S
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                started = sorted(path.name for path in root.glob("*.running"))
                pytest.fail(f"the training processes did not finish within {DEADLINE_S} s; runs started: {started}; node logs under {root}")
    finally:
        for node in nodes.values():
            node.stop()
    return {(name, system): [torch.load(Path(out.format(rank=rank))) for rank in range(ddp_programs.WORLD_SIZE)] for name, system, _, _, out in runs}


def assert_bitwise(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], what: str) -> None:
    assert expected.keys() == actual.keys()
    differing = [name for name in expected if not torch.equal(expected[name], actual[name])]
    assert not differing, f"{what}: {differing} differ (max {max(float((expected[n].double() - actual[n].double()).abs().max()) for n in differing):.3g})"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_matches_torch_and_ddp_bitwise(outcomes, scenario):
    torch_ranks, netoptim_ranks = outcomes[(scenario, "torch")], outcomes[(scenario, "netoptim")]
    for rank in range(ddp_programs.WORLD_SIZE):
        assert_bitwise(torch_ranks[rank], netoptim_ranks[rank], f"{scenario}, rank {rank}")
    # Parameters are equal on every rank; buffers only after the next forward's broadcast, as with DDP.
    params = [{n: t for n, t in ranked.items() if n.startswith("param.")} for ranked in netoptim_ranks]
    assert_bitwise(params[0], params[1], f"{scenario}: the ranks")


def test_a_parameter_no_rank_uses_is_never_stepped(outcomes):
    torch.manual_seed(0)
    initial = ddp_programs.Branches()
    final = outcomes[("unused", "netoptim")][0]
    assert torch.equal(final["param.never.weight"], initial.never.weight.detach())  # no decay, no momentum
    assert not torch.equal(final["param.rank1_only.weight"], initial.rank1_only.weight.detach())


def test_a_param_group_added_mid_run_trains_from_then_on(outcomes):
    torch.manual_seed(0)
    initial = ddp_programs.WithLateGroup()
    final = outcomes[("add_param_group", "netoptim")][1]
    assert not torch.equal(final["param.late.weight"], initial.late.weight.detach())
    assert torch.equal(final["param.late.weight"], outcomes[("add_param_group", "torch")][1]["param.late.weight"])
