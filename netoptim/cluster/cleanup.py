"""Run prefixes, who owns them, and removing what a run left behind.

Every name a run creates starts with its prefix, ``nopt`` and six hex digits (``nopt3fa9c1``), so two
runs never collide and ``netoptim cluster --cleanup`` finds leftovers by name alone. A run records its
process (id and start time, so a reused pid is not mistaken for it) in ``/run/netoptim-cluster``;
cleanup leaves a prefix alone while its owner lives, unless forced.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from netoptim.cluster import netns

log = logging.getLogger(__name__)

BASE = "nopt"
PREFIX_RE = re.compile(rf"^({BASE}[0-9a-f]{{6}})-")
OWNERS_DIR = Path("/run/netoptim-cluster")


def new_prefix() -> str:
    """A fresh run prefix, ``nopt`` + 6 random hex digits: short enough for 15-character interface names."""
    return f"{BASE}{secrets.token_hex(3)}"


def check_prefix(prefix: str) -> str:
    """``prefix`` if it is a run prefix; ``ValueError`` otherwise (so cleanup never matches foreign names)."""
    if not PREFIX_RE.match(prefix + "-"):
        raise ValueError(f"{prefix!r} is not a cluster run prefix like {BASE}3fa9c1 ({BASE} and 6 hex digits)")
    return prefix


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after the command name, which may contain spaces


def record_owner(prefix: str) -> None:
    """Note that this process owns ``prefix`` (read by :func:`cleanup`)."""
    OWNERS_DIR.mkdir(parents=True, exist_ok=True)
    record = {"pid": os.getpid(), "start_time": _start_time(os.getpid())}
    (OWNERS_DIR / f"{prefix}.json").write_text(json.dumps(record))


def forget_owner(prefix: str) -> None:
    (OWNERS_DIR / f"{prefix}.json").unlink(missing_ok=True)


def owner_alive(prefix: str) -> bool:
    """Whether the process that created ``prefix`` still runs (False when no record is left)."""
    try:
        record = json.loads((OWNERS_DIR / f"{prefix}.json").read_text())
    except (OSError, ValueError):
        return False
    return record.get("start_time") is not None and _start_time(int(record["pid"])) == record["start_time"]


def leftover_namespaces(prefix: str | None = None) -> dict[str, list[str]]:
    """Namespaces of cluster runs, by prefix (only ``prefix``'s when given)."""
    found: dict[str, list[str]] = {}
    for name in netns.list_namespaces():
        match = PREFIX_RE.match(name)
        if match and (prefix is None or match.group(1) == prefix):
            found.setdefault(match.group(1), []).append(name)
    return found


def leftover_links(prefix: str | None = None) -> list[str]:
    """Interfaces in this (the machine's) namespace whose names carry a run prefix: there should be
    none, as runs create theirs inside their namespaces, but a half-made run could leave one."""
    names = []
    for line in netns.run("ip", "-o", "link", "show").splitlines():
        parts = line.split(":", 2)
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@", 1)[0]
        match = PREFIX_RE.match(name)
        if match and (prefix is None or match.group(1) == prefix):
            names.append(name)
    return names


def remove_run(prefix: str) -> list[str]:
    """Remove everything of run ``prefix``: processes in its namespaces, the namespaces (with their
    veths and bridge), stray interfaces, its owner record. Returns what was removed."""
    check_prefix(prefix)
    removed = []
    namespaces = leftover_namespaces(prefix).get(prefix, [])
    switch = [name for name in namespaces if name.endswith("-sw")]
    for name in [n for n in namespaces if n not in switch] + switch:  # hosts first: their veths leave the bridge
        netns.delete_namespace(name)
        removed.append(f"namespace {name}")
    for name in leftover_links(prefix):
        netns.run("ip", "link", "delete", name, check=False)
        removed.append(f"link {name}")
    forget_owner(prefix)
    return removed


def cleanup(prefix: str | None = None, *, force: bool = False) -> tuple[list[str], list[str]]:
    """Remove leftovers of runs whose owner is gone (any owner with ``force``); ``prefix`` limits it to
    one run. Returns (what was removed, prefixes skipped because their run is still going)."""
    netns.require_root()
    prefixes = set(leftover_namespaces(prefix)) | {PREFIX_RE.match(n).group(1) for n in leftover_links(prefix)}  # type: ignore[union-attr]
    if OWNERS_DIR.is_dir():  # records of runs that left nothing else
        prefixes |= {p.stem for p in OWNERS_DIR.glob(f"{BASE}*.json") if PREFIX_RE.match(p.stem + "-") and prefix in (None, p.stem)}
    removed, skipped = [], []
    for run_prefix in sorted(prefixes):
        if not force and owner_alive(run_prefix):
            log.info("leaving %s alone: the run that made it (still) runs; --force removes it anyway", run_prefix)
            skipped.append(run_prefix)
            continue
        removed.extend(remove_run(run_prefix))
    return removed, skipped


@dataclass(frozen=True)
class Names:
    """The names of one run's namespaces and interfaces, all under its prefix."""

    prefix: str

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    def host(self, host: str) -> str:
        """The namespace of host ``host`` ("w0", "n1"); also the name of its switch-side veth (15 characters at most)."""
        return f"{self.prefix}-{host}"
