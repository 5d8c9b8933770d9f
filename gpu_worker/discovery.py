"""Where a job's optimizer nodes are: the ordered list of their data-plane addresses.

The order is the node index :func:`protos.job.placement.plan_buckets` deals buckets by, so every rank of a
job must use the same list in the same order. A worker gets it from one of, first match wins:

1. the ``nodes`` argument: a list of addresses (used as given), or the path of a *host file*;
2. ``NETOPTIM_NODES``: addresses separated by commas;
3. ``NETOPTIM_NODE_FILE``: the path of a host file.

A host file holds one address per line; ``#`` starts a comment, blank lines are skipped, and every
address is checked (an error names the file and the line). :func:`resolve_nodes` is that rule, a
pure function of its arguments, the environment given to it and the file it names.

Under ``torch.distributed`` (an initialized process group) or ``torchrun`` (its agent's store, so no
process group is needed), :func:`discover_nodes` lets rank 0 alone resolve the list and publish it
in the job's c10d store; every other rank reads rank 0's list from there (:func:`share_nodes`). The
host file, or the variables, are then needed on rank 0's host only, and ranks on hosts whose files
differ still agree.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

NODES_ENV = "NETOPTIM_NODES"
"""Environment variable: the nodes' addresses, separated by commas."""

NODE_FILE_ENV = "NETOPTIM_NODE_FILE"
"""Environment variable: the path of a host file."""

STORE_PREFIX = "netoptim/nodes"
"""Keys of the node lists rank 0 publishes in the job's c10d store start with this."""

NodeSource = Sequence[str] | str | os.PathLike | None
"""What a worker may be given as ``nodes``: addresses, a host file's path, or ``None`` (the environment)."""

_published = itertools.count()  # the n-th list shared by this process has key .../n on every rank


@dataclass(frozen=True, slots=True)
class NodeList:
    """The nodes' addresses in placement order, and where they came from (for logs and errors)."""

    addresses: tuple[str, ...]
    """Data-plane addresses; index ``i`` is node ``i`` of the placement."""

    source: str
    """Where they came from: ``"the nodes argument"``, ``"NETOPTIM_NODES"``, ``"host file PATH"``, ..."""


def check_address(text: str) -> str:
    """``text`` without surrounding blanks, if it is an address a worker can connect to;
    ``ValueError`` saying what is wrong otherwise."""
    from transport import backend_for

    address = text.strip()
    backend_for(address)  # the scheme: tcp, ipc, mooncake, mooncake+rdma
    if any(character.isspace() for character in address):
        raise ValueError(f"address {address!r} holds a blank: one address per entry")
    scheme, _, rest = address.partition("://")
    if scheme != "ipc":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"address {address!r} needs a host and a port from 1 to 65535, like {scheme}://10.0.0.11:5555")
    return address


def _checked(addresses: Sequence[str], where: Callable[[int], str]) -> tuple[str, ...]:
    """The addresses, each checked and none twice; errors start with ``where(i)`` for entry ``i``."""
    seen: dict[str, int] = {}
    for index, address in enumerate(addresses):
        try:
            check_address(address)
        except ValueError as exc:
            raise ValueError(f"{where(index)}: {exc}") from None
        if address in seen:  # two node indices on one node: it would get two different shares
            raise ValueError(f"{where(index)}: {address} is listed twice (also {where(seen[address])}); list every node once")
        seen[address] = index
    return tuple(addresses)


def parse_host_file(text: str, path: str) -> tuple[str, ...]:
    """The addresses in a host file's ``text`` (``path`` names it in errors): one per line, ``#``
    comments and blank lines skipped. ``ValueError`` naming ``PATH:LINE`` for a bad line, or for a
    file that lists no address."""
    entries: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        content = line.split("#", 1)[0].strip()
        if content:
            entries.append((number, content))
    if not entries:
        raise ValueError(f"host file {path} lists no node: write one address per line, like tcp://10.0.0.11:5555")
    return _checked([address for _, address in entries], lambda i: f"{path}:{entries[i][0]}")


def read_host_file(path: str | os.PathLike) -> tuple[str, ...]:
    """The addresses in the host file at ``path`` (see :func:`parse_host_file`); ``ValueError``
    naming the file when it cannot be read."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"cannot read the host file {os.fspath(path)}: {reason}") from None
    return parse_host_file(text, os.fspath(path))


def resolve_nodes(nodes: NodeSource = None, *, environ: Mapping[str, str] | None = None) -> NodeList:
    """The node list from ``nodes`` or, when it is ``None``, from ``environ`` (default: ``os.environ``).

    ``nodes`` is a list of addresses (every one checked, none twice), or a host file's path (``str``
    or ``os.PathLike``). A ``str`` holding ``://`` is an address, not a path: it is refused, to be
    given as a list. With ``nodes=None``, ``NETOPTIM_NODES`` wins over ``NETOPTIM_NODE_FILE`` (a
    warning says the file is ignored when both are set; empty values count as unset).
    ``TypeError`` for a ``nodes`` of another type, ``ValueError`` for a bad address, host file or
    an empty list, or when nothing says where the nodes are.
    """
    if isinstance(nodes, str) and "://" in nodes:
        raise ValueError(
            f"nodes must be a non-empty list of addresses like ['tcp://127.0.0.1:5555'] or a host file's path, got {nodes!r}: "
            f"give addresses as a list (or in ${NODES_ENV}, separated by commas)"
        )
    if isinstance(nodes, (str, os.PathLike)):
        return NodeList(read_host_file(nodes), f"host file {os.fspath(nodes)}")
    if nodes is not None:
        if not isinstance(nodes, Sequence) or not all(isinstance(node, str) for node in nodes):
            raise TypeError(f"nodes must be a list of address strings, a host file's path or None, got {nodes!r}")
        if not nodes:
            raise ValueError("nodes must be a non-empty list of addresses like ['tcp://127.0.0.1:5555'], got []")
        return NodeList(_checked([node.strip() for node in nodes], lambda i: f"nodes[{i}]"), "the nodes argument")
    environ = os.environ if environ is None else environ
    listed, file = environ.get(NODES_ENV, "").strip(), environ.get(NODE_FILE_ENV, "").strip()
    if listed:
        if file:
            log.warning("both %s and %s are set: using %s, ignoring the host file %s", NODES_ENV, NODE_FILE_ENV, NODES_ENV, file)
        parts = [part.strip() for part in listed.split(",") if part.strip()]
        return NodeList(_checked(parts, lambda i: f"{NODES_ENV} entry {i + 1}"), NODES_ENV)
    if file:
        return NodeList(read_host_file(file), f"host file {file} (${NODE_FILE_ENV})")
    raise ValueError(
        f"no optimizer nodes given: pass nodes=[addresses] or a host file's path, or set ${NODES_ENV} (addresses separated by commas) "
        f"or ${NODE_FILE_ENV} (a host file: one address per line) on rank 0's host at least"
    )


def nodes_option(text: str | None) -> NodeSource:
    """A ``--nodes`` flag's value as ``nodes``: ``None`` when not given (the environment), addresses
    separated by commas when it holds ``://``, otherwise a host file's path."""
    if text is None or not text.strip():
        return None
    return [part.strip() for part in text.split(",") if part.strip()] if "://" in text else text.strip()


def share_nodes(store: Any, rank: int, resolve: Callable[[], NodeList], *, key: str, timeout_s: float) -> NodeList:
    """Rank 0 calls ``resolve()`` and publishes the list (or its error) under ``key`` in the c10d
    ``store``; every other rank waits up to ``timeout_s`` for it and returns rank 0's list.

    Rank 0 raises what ``resolve()`` raised; the others raise ``ValueError`` with rank 0's reason,
    and ``TimeoutError`` when nothing came within ``timeout_s``."""
    if rank == 0:
        try:
            resolved = resolve()
        except (ValueError, TypeError) as exc:
            store.set(key, json.dumps({"error": str(exc)}))
            raise
        store.set(key, json.dumps({"nodes": list(resolved.addresses), "source": resolved.source}))
        log.info("rank 0 published %d optimizer node(s) from %s: %s", len(resolved.addresses), resolved.source, ", ".join(resolved.addresses))
        return resolved
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        raw = store.get(key)
    except RuntimeError as exc:  # torch's DistStoreError: a timeout, or the store went away
        raise TimeoutError(
            f"rank {rank}: rank 0 did not publish the optimizer nodes within {timeout_s:g} s (key {key!r}): is rank 0 running, and does it "
            f"build its optimizer with the same kind of nodes argument (a host file or None)? ({exc})"
        ) from None
    message = json.loads(bytes(raw).decode("utf-8"))
    if "error" in message:
        raise ValueError(f"rank {rank}: rank 0 could not find the optimizer nodes: {message['error']}")
    addresses = _checked(message["nodes"], lambda i: f"rank 0's node {i}")
    log.info("rank %d uses rank 0's %d optimizer node(s) (from its %s): %s", rank, len(addresses), message["source"], ", ".join(addresses))
    return NodeList(addresses, f"rank 0 ({message['source']})")


def agent_store_address(environ: Mapping[str, str]) -> tuple[str, int, int] | None:
    """``(host, port, rank)`` of the c10d store ``torchrun`` (with any rendezvous backend) gives its
    workers, read from the variables it sets; ``None`` outside ``torchrun`` or for one worker."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        if int(environ["WORLD_SIZE"]) <= 1:
            return None
        return environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), int(environ["RANK"])
    except (KeyError, ValueError):
        return None


def _store_key(environ: Mapping[str, str]) -> str:
    """A key no earlier list in the same store has: torchrun's run id and restart count, then a count
    of this process's lists (every rank publishes or reads the same number of them, in order)."""
    run, attempt = environ.get("TORCHELASTIC_RUN_ID", "none"), environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"{STORE_PREFIX}/{run}/{attempt}/{next(_published)}"


def discover_nodes(nodes: NodeSource = None, *, timeout_s: float = 300.0, environ: Mapping[str, str] | None = None) -> list[str]:
    """The node list a worker uses (what :class:`~gpu_worker.RemoteAdamW` calls with its ``nodes``).

    A list of addresses is used as given (checked). A host file's path or ``None`` is resolved by
    :func:`resolve_nodes` on rank 0 and shared through the job's c10d store (:func:`share_nodes`):
    the default process group's store when ``torch.distributed`` is initialized, else the store of
    ``torchrun``'s agent; without either (one process, a hand-made launcher) every rank resolves it
    itself, so each needs the same variables or file."""
    environ = os.environ if environ is None else environ
    if nodes is not None and not isinstance(nodes, (str, os.PathLike)):
        return list(resolve_nodes(nodes).addresses)

    def resolve() -> NodeList:
        return resolve_nodes(nodes, environ=environ)

    def resolve_here() -> list[str]:
        resolved = resolve()
        log.info("optimizer nodes (%d) from %s: %s", len(resolved.addresses), resolved.source, ", ".join(resolved.addresses))
        return list(resolved.addresses)

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() == 1:
            return resolve_here()
        from torch.distributed.distributed_c10d import _get_default_store  # the store init_process_group made

        return list(share_nodes(_get_default_store(), dist.get_rank(), resolve, key=_store_key(environ), timeout_s=timeout_s).addresses)
    agent = agent_store_address(environ)
    if agent is None:
        return resolve_here()
    host, port, rank = agent
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise TimeoutError(f"rank {rank}: cannot reach torchrun's store at {host}:{port} to share the optimizer nodes: {exc}") from None
    return list(share_nodes(store, rank, resolve, key=_store_key(environ), timeout_s=timeout_s).addresses)
