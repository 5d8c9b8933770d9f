"""Same-host shared memory: windows through which a node and a worker on one host pass payloads
without the kernel, and a node's parameter board (one copy of the values, read by all its same-host
workers)."""
