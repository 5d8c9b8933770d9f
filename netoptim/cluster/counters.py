"""Bytes each emulated link carried, from the veth counters on the switch side.

The switch-side veth of a host sees every frame of its link: what it receives came from the host
(upload), what it transmits went to the host (download). The counts are whole Ethernet frames (TCP/IP
headers included), and a retransmitted segment counts each time it is sent, as on a real NIC.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from netoptim.cluster import netns
from netoptim.cluster.topology import Topology


@dataclass(frozen=True)
class LinkBytes:
    """Bytes on one host's link."""

    up: int
    """From the host into the switch."""
    down: int
    """From the switch to the host."""

    def __sub__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(self.up - other.up, self.down - other.down)


def read_counters(topology: Topology) -> dict[str, LinkBytes]:
    """Every host's link counters now, by host name (one ``ip -s -j link`` call: one consistent read)."""
    links = json.loads(netns.run("ip", "-n", topology.switch, "-s", "-j", "link", "show"))
    by_name = {link["ifname"]: link for link in links}
    counts = {}
    for host in topology.hosts:
        stats = by_name[host.link]["stats64"]
        counts[host.name] = LinkBytes(up=int(stats["rx"]["bytes"]), down=int(stats["tx"]["bytes"]))
    return counts


def difference(after: dict[str, LinkBytes], before: dict[str, LinkBytes]) -> dict[str, LinkBytes]:
    """What each link carried between two reads."""
    return {name: after[name] - before[name] for name in after}
