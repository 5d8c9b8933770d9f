"""The emulated hosts and their links: one namespace per host, a bridge in a switch namespace.

```
  switch namespace PREFIX-sw                         host namespaces
  ┌───────────────────────────────────┐
  │ bridge PREFIX-br                  │
  │   ├── veth PREFIX-w0 ─────────────┼───── eth0 10.231.0.1   in PREFIX-w0 (worker host 0)
  │   ├── veth PREFIX-w1 ─────────────┼───── eth0 10.231.0.2   in PREFIX-w1 (worker host 1)
  │   └── veth PREFIX-n0 ─────────────┼───── eth0 10.231.0.3   in PREFIX-n0 (node host 0)
  └───────────────────────────────────┘
```

The bridge lives in a namespace of its own rather than in the machine's: nothing is created next to
the machine's interfaces, its firewall (which may filter bridged traffic) never sees these packets,
and every run has a private switch, so concurrent runs may even use the same addresses.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass, field

from netoptim.cluster import netns
from netoptim.cluster.cleanup import Names, check_prefix, record_owner, remove_run

log = logging.getLogger(__name__)

HOST_IFACE = "eth0"
DEFAULT_SUBNET = "10.231.0.0/24"
MAX_HOSTS = 64  # interface names: prefix (10) + "-w" + 2 digits stays within Linux's 15 characters


@dataclass(frozen=True)
class Host:
    """One emulated machine."""

    name: str
    """``w0``, ``w1``... for worker hosts, ``n0``... for node hosts."""
    role: str
    """``worker`` or ``node``."""
    namespace: str
    address: str
    """Its IPv4 address on the bridge."""
    link: str
    """Its veth's name on the switch side (in the switch namespace): where its link is shaped and counted."""


@dataclass
class Topology:
    """H worker hosts and N node hosts of one run, all named under ``prefix``."""

    prefix: str
    hosts: list[Host] = field(default_factory=list)
    subnet: str = DEFAULT_SUBNET

    @property
    def names(self) -> Names:
        return Names(self.prefix)

    @property
    def switch(self) -> str:
        """The switch namespace (bridge and switch-side veths)."""
        return self.names.switch

    @property
    def worker_hosts(self) -> list[Host]:
        return [h for h in self.hosts if h.role == "worker"]

    @property
    def node_hosts(self) -> list[Host]:
        return [h for h in self.hosts if h.role == "node"]


def plan_topology(worker_hosts: int, node_hosts: int, prefix: str, subnet: str = DEFAULT_SUBNET) -> Topology:
    """Names and addresses of a cluster; creates nothing. ``ValueError`` for counts or a subnet that do not fit."""
    check_prefix(prefix)
    if worker_hosts < 1 or node_hosts < 0:
        raise ValueError(f"need at least one worker host and no negative node hosts, got {worker_hosts} and {node_hosts}")
    if worker_hosts + node_hosts > MAX_HOSTS:
        raise ValueError(f"{worker_hosts + node_hosts} hosts: at most {MAX_HOSTS} (interface names are limited to 15 characters)")
    try:
        network = ipaddress.IPv4Network(subnet)
    except ValueError as exc:
        raise ValueError(f"subnet {subnet!r}: {exc}") from None
    if not network.is_private:
        raise ValueError(f"subnet {subnet} is not a private range: use one like {DEFAULT_SUBNET}")
    if network.num_addresses - 2 < worker_hosts + node_hosts:
        raise ValueError(f"subnet {subnet} has room for {network.num_addresses - 2} hosts, not {worker_hosts + node_hosts}")
    names = Names(prefix)
    roles = [("worker", f"w{i}") for i in range(worker_hosts)] + [("node", f"n{i}") for i in range(node_hosts)]
    hosts = [
        Host(name=name, role=role, namespace=names.host(name), address=str(network.network_address + 1 + index), link=names.host(name))
        for index, (role, name) in enumerate(roles)
    ]
    return Topology(prefix=prefix, hosts=hosts, subnet=str(network))


def build(topology: Topology) -> None:
    """Create the switch, the hosts and their links; on any failure, remove what was made and re-raise."""
    netns.require_root()
    record_owner(topology.prefix)  # first: a runner killed half-way is still known to --cleanup as dead
    prefix_len = topology.subnet.split("/")[1]
    try:
        netns.add_namespace(topology.switch)
        netns.run("ip", "-n", topology.switch, "link", "add", topology.names.bridge, "type", "bridge")
        netns.run("ip", "-n", topology.switch, "link", "set", topology.names.bridge, "up")
        for host in topology.hosts:
            netns.add_namespace(host.namespace)
            # Made inside the switch namespace with its peer straight in the host's: never in the machine's.
            netns.run("ip", "-n", topology.switch, "link", "add", host.link, "type", "veth", "peer", "name", HOST_IFACE, "netns", host.namespace)
            netns.run("ip", "-n", topology.switch, "link", "set", host.link, "master", topology.names.bridge)
            netns.run("ip", "-n", topology.switch, "link", "set", host.link, "up")
            netns.run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/{prefix_len}", "dev", HOST_IFACE)
            netns.run("ip", "-n", host.namespace, "link", "set", HOST_IFACE, "up")
        log.info("cluster %s: %d worker host(s), %d node host(s) on %s", topology.prefix, len(topology.worker_hosts), len(topology.node_hosts), topology.subnet)
    except BaseException:
        teardown(topology)
        raise


def teardown(topology: Topology) -> list[str]:
    """Remove every process, namespace and interface of the run; returns what was removed."""
    removed = remove_run(topology.prefix)
    log.info("cluster %s removed: %s", topology.prefix, ", ".join(removed) or "nothing was left")
    return removed
