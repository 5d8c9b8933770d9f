"""The cluster step-time model: compute plus the busiest link's payload time, netoptim's stretched by
its bucket pipeline; shared cores slow the compute down."""

from __future__ import annotations

import pytest

from netoptim.planning.cluster_model import TCP_PAYLOAD_SHARE, ClusterTiming, predict_step


def timing(**changes) -> ClusterTiming:
    return ClusterTiming(**{"compute_s": 0.5, "link_bit_s": 8e6, "ranks": 2, "cores": 2.0, "buckets": 8, **changes})


def test_a_step_is_compute_plus_the_busiest_links_time():
    links = {"w0": 1e6, "w1": 1e6, "n0": 2e6}
    rate = 1e6 * TCP_PAYLOAD_SHARE  # 8 Mbit/s, less the headers
    fsdp = predict_step("fsdp", {"w0": 3e6, "w1": 3e6, "n0": 0.0}, timing())
    assert fsdp.step_s == pytest.approx(0.5 + 3e6 / rate) and fsdp.busiest_link == "w0"
    netoptim = predict_step("netoptim", links, timing())
    assert netoptim.busiest_link == "n0"
    assert netoptim.communication_s == pytest.approx(2e6 / rate * (1 + 1 / 8))
    more_buckets = predict_step("netoptim", links, timing(buckets=64))
    assert more_buckets.step_s < netoptim.step_s
    with_update = predict_step("netoptim", links, timing(node_update_s=0.25))
    assert with_update.step_s == pytest.approx(netoptim.step_s + 0.25)


def test_faster_node_links_move_the_bound_to_the_link_whose_bytes_take_longest():
    links = {"w0": 1e6, "w1": 1e6, "n0": 2e6}
    rate = 1e6 * TCP_PAYLOAD_SHARE
    even = predict_step("netoptim", links, timing(node_link_bit_s=16e6))  # twice the workers': n0's 2 MB take as long as w0's 1 MB
    assert even.communication_s == pytest.approx(1e6 / rate * (1 + 1 / 8))
    faster = predict_step("netoptim", links, timing(node_link_bit_s=32e6))
    assert faster.busiest_link == "w0" and faster.communication_s == pytest.approx(even.communication_s)
    assert predict_step("netoptim", links, timing(node_link_bit_s=0.0)).busiest_link == "n0"  # 0: the workers' rate


def test_ranks_beyond_the_shared_cores_stretch_the_compute():
    links = {"w0": 1e6}
    assert predict_step("ddp", links, timing(ranks=8)).compute_s == pytest.approx(0.5 * 4)
    assert predict_step("ddp", links, timing(ranks=8, cores=None)).compute_s == pytest.approx(0.5)
    assert predict_step("ddp", links, timing(ranks=1)).compute_s == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"compute_s": 0.0}, "positive"), ({"cores": -1.0}, "cores"), ({"buckets": 0}, "positive"), ({"node_link_bit_s": -1.0}, "node hosts")],
)
def test_bad_timings_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        timing(**changes)


def test_unknown_modes_and_no_links_are_refused():
    with pytest.raises(ValueError, match="one of netoptim, fsdp, ddp"):
        predict_step("zero", {"w0": 1.0}, timing())
    with pytest.raises(ValueError, match="no links"):
        predict_step("ddp", {}, timing())
