"""An emulated cluster on one machine: ``netoptim cluster`` and ``netoptim bench cluster``.

Each host is a Linux network namespace; a private "switch" namespace holds a bridge and the host-side
end of every host's veth, and ``tc`` shapes both directions of each link. Nothing is created in the
machine's own network namespace, so the machine's interfaces, routes and firewall are never touched,
and runs with different prefixes cannot collide (each has its own switch, even its own addresses).

| module | job |
|---|---|
| ``netns.py`` | running ``ip``/``tc``; creating, listing and deleting namespaces; the processes inside them |
| ``topology.py`` | the hosts, their addresses, the bridge and the veths (build and tear down) |
| ``shaping.py`` | a rate on each link, both directions (``tc`` tbf) |
| ``cleanup.py`` | run prefixes, owner records, removing what a dead run left (``netoptim cluster --cleanup``) |
| ``counters.py`` | bytes each link carried, from the switch-side veth counters |
| ``scaling.py`` | the link rate that gives this CPU the compute/communication ratio of a target GPU cluster |
| ``worker.py`` | the worker program: netoptim, FSDP or DDP training of a small GPT, with barriers around the timed steps |
| ``runner.py`` | starting nodes and workers on the hosts (or on loopback), timing the steps, reading the counters |
| ``report.py`` | the bytes model, and the report as JSON and text |
| ``session.py`` | one whole run: build, scale, shape, run the jobs, always tear down (signals included) |
"""
