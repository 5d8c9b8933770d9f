"""A rate on each emulated link, in both directions, with ``tc``'s token bucket filter (tbf).

A qdisc shapes what leaves an interface, so one link needs two: on the switch-side veth (traffic to
the host: its download) and on the host's ``eth0`` (traffic from it: its upload). Both get the same
rate, like a full-duplex NIC port.
"""

from __future__ import annotations

import json
import logging

from netoptim.cluster import netns
from netoptim.cluster.topology import HOST_IFACE, Host, Topology

log = logging.getLogger(__name__)

MIN_RATE_BIT_S = 100e3  # below this a single MTU-sized burst is longer than most timeouts care about


def tbf_args(rate_bit_s: float) -> list[str]:
    """``tc`` arguments of a tbf at ``rate_bit_s``.

    Burst: 5 ms at the rate, at least 32 KiB, so the bucket holds a few full-size frames and the
    timer's granularity does not cost rate. Queue: at least 1 MiB (100 ms at the rate above that), a
    data-center switch port's share of buffer. Bytes, not time, carry over from the target: the
    emulated link runs ``1/scale`` times slower, so a buffer that holds X µs at the target's rate
    holds X/scale at the emulated one, the same bytes. With 256 KiB, the two workers' streams into
    one node host lost 8-18% of their segments to the queue (retransmitted, counted again on the
    workers' links); with 1 MiB, none, and the steps were no slower.
    """
    if not rate_bit_s >= MIN_RATE_BIT_S:
        raise ValueError(f"link rate {rate_bit_s:.0f} bit/s: at least {MIN_RATE_BIT_S:.0f} bit/s")
    rate_bytes = rate_bit_s / 8
    burst = max(32 << 10, int(rate_bytes * 0.005))
    limit = max(1 << 20, int(rate_bytes * 0.1))
    return ["tbf", "rate", f"{int(rate_bit_s)}bit", "burst", str(burst), "limit", str(limit)]


def shape_link(topology: Topology, host: Host, rate_bit_s: float) -> None:
    """Set ``host``'s link to ``rate_bit_s`` each way (replacing an earlier rate)."""
    args = tbf_args(rate_bit_s)
    netns.run("tc", "-n", topology.switch, "qdisc", "replace", "dev", host.link, "root", *args)  # to the host
    netns.run("tc", "-n", host.namespace, "qdisc", "replace", "dev", HOST_IFACE, "root", *args)  # from the host


def shape_all(topology: Topology, rate_bit_s: float, *, node_rate_bit_s: float | None = None) -> None:
    """Every worker host's link at ``rate_bit_s`` each way, every node host's at ``node_rate_bit_s``
    (None: the same)."""
    node_rate = node_rate_bit_s or rate_bit_s
    for host in topology.worker_hosts:
        shape_link(topology, host, rate_bit_s)
    for host in topology.node_hosts:
        shape_link(topology, host, node_rate)
    if node_rate == rate_bit_s:
        log.info("cluster %s: every link shaped to %.3g Mbit/s each way", topology.prefix, rate_bit_s / 1e6)
    else:
        log.info(
            "cluster %s: worker hosts' links shaped to %.3g Mbit/s, node hosts' to %.3g Mbit/s, each way", topology.prefix, rate_bit_s / 1e6, node_rate / 1e6
        )


def link_rates(topology: Topology, host: Host) -> tuple[float, float]:
    """(to the host, from the host) rates in bit/s that tbf enforces now, read back from ``tc``."""
    return _tbf_rate(topology.switch, host.link), _tbf_rate(host.namespace, HOST_IFACE)


def _tbf_rate(namespace: str, device: str) -> float:
    qdiscs = json.loads(netns.run("tc", "-n", namespace, "-j", "qdisc", "show", "dev", device) or "[]")
    for qdisc in qdiscs:
        if qdisc.get("kind") == "tbf":
            return float(qdisc["options"]["rate"]) * 8  # tc's JSON gives bytes per second
    raise ValueError(f"no tbf on {device} in {namespace}")
