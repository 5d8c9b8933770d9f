"""Machine types a job can rent, read from a TOML catalog (``netoptim plan --catalog FILE``).

One ``[[machine]]`` table per type. Every error names the file, the line and the key, as the
project's other TOML files do (see :mod:`netoptim.job.config_file`)::

    note = "illustrative prices, not a quote"     # optional, printed with every plan
    currency = "USD"                              # optional (default USD)

    [[machine]]
    name = "gpu-a"
    price_per_hour = 2.50              # on demand
    spot_price_per_hour = 0.90         # optional: no spot offer without it
    spot_preemptions_per_hour = 0.08   # with a spot price: how often one machine is taken back
    cpu_cores = 8
    memory_gib = 64
    gpu_kind = "A"                     # a label; GPU types need the three keys below too
    gpu_count = 1
    gpu_memory_gib = 24
    gpu_speed = 40.0                   # one GPU's throughput over one rank of the calibration
    network_gbps = 25
    roles = ["worker"]                 # optional: default worker with GPUs, node without
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKER, NODE = "worker", "node"
_REQUIRED = ("name", "price_per_hour", "cpu_cores", "memory_gib", "network_gbps")
_GPU_KEYS = ("gpu_kind", "gpu_memory_gib", "gpu_speed")
_OPTIONAL = ("spot_price_per_hour", "spot_preemptions_per_hour", "gpu_count", "network_latency_us", "roles", *_GPU_KEYS)
_TOP_LEVEL = ("note", "currency", "machine")


class CatalogError(ValueError):
    """A catalog that cannot be used; the message names the file, the line and the key."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MachineType:
    """One machine type of the catalog: what it costs and what it holds."""

    name: str
    """Unique name, as the plan prints it."""
    price_per_hour: float
    """On-demand price of one machine for an hour."""
    spot_price_per_hour: float | None = None
    """Spot price for an hour; None: no spot offer."""
    spot_preemptions_per_hour: float = 0.0
    """How often one spot machine of this type is taken back, per hour (0.1: once in 10 hours)."""
    cpu_cores: int
    """Cores a node on this machine updates with (and the workers' host cores)."""
    memory_gib: float
    """Host memory: what a node's state and received gradients must fit in."""
    gpu_kind: str = ""
    """A label for the GPU ("" without GPUs)."""
    gpu_count: int = 0
    """GPUs per machine: one worker rank each."""
    gpu_memory_gib: float = 0.0
    """Memory of one GPU: what a rank's parameters, gradients and activations must fit in."""
    gpu_speed: float = 0.0
    """One GPU's compute throughput over the calibrated device's (one rank of the calibration run,
    which on a machine without a GPU is one CPU core): a stated multiplier, not a measurement."""
    network_gbps: float
    """Network bandwidth of one machine, in Gbit/s each way (shared by its ranks)."""
    network_latency_us: float = 50.0
    """One-way latency between two machines, in microseconds."""
    roles: tuple[str, ...] = ()
    """What the type may run: ``worker`` (needs GPUs), ``node``, or both."""
    line: int = 0
    """Line of its ``[[machine]]`` header in the catalog (for messages)."""

    @property
    def network_bytes_per_s(self) -> float:
        return self.network_gbps * 1e9 / 8

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    @property
    def gpu_memory_bytes(self) -> int:
        return int(self.gpu_memory_gib * 2**30)

    def price(self, spot: bool) -> float:
        """Hourly price, on spot or on demand."""
        if spot and self.spot_price_per_hour is None:
            raise ValueError(f"machine type {self.name!r} has no spot price")
        return self.spot_price_per_hour if spot and self.spot_price_per_hour is not None else self.price_per_hour


@dataclass(frozen=True, slots=True)
class Catalog:
    """The machine types of one catalog file."""

    path: str
    machines: tuple[MachineType, ...]
    note: str = ""
    currency: str = "USD"
    workers: tuple[MachineType, ...] = field(init=False)
    nodes: tuple[MachineType, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", tuple(m for m in self.machines if WORKER in m.roles))
        object.__setattr__(self, "nodes", tuple(m for m in self.machines if NODE in m.roles))


def load_catalog(path: str | Path) -> Catalog:
    """Read and check the catalog at ``path``; :class:`CatalogError` names the file, line and key."""
    try:
        text = Path(path).read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        raise CatalogError(f"cannot read the catalog {path}: {exc.strerror or exc}") from None
    return parse_catalog(text, str(path))


def parse_catalog(text: str, path: str = "<catalog>") -> Catalog:
    """The catalog in ``text`` (``path`` names it in messages)."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"{path}: not valid TOML: {exc}") from None
    for key in document:
        if key not in _TOP_LEVEL:
            raise CatalogError(f"{path}:{_top_line(text, key)}: unknown key {key!r}; the top level takes {', '.join(_TOP_LEVEL)}")
    for key in ("note", "currency"):
        if key in document and not isinstance(document[key], str):
            raise CatalogError(f"{path}:{_top_line(text, key)}: {key} must be a string, not {document[key]!r}")
    tables = document.get("machine")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise CatalogError(f"{path}: no machine types: add [[machine]] tables (see examples/machines.toml)")
    headers = [text.count("\n", 0, m.start()) + 1 for m in re.finditer(r"^[ \t]*\[\[[ \t]*machine[ \t]*\]\]", text, re.MULTILINE)]
    machines: list[MachineType] = []
    for index, table in enumerate(tables):
        start = headers[index] if index < len(headers) else 0
        end = headers[index + 1] if index + 1 < len(headers) else None
        machines.append(_machine(table, _Where(path, text, start, end)))
    seen: dict[str, int] = {}
    for machine in machines:
        if machine.name in seen:
            raise CatalogError(f"{path}:{machine.line}: name {machine.name!r} is used twice (first on line {seen[machine.name]})")
        seen[machine.name] = machine.line
    catalog = Catalog(path, tuple(machines), document.get("note", ""), document.get("currency", "USD"))
    if not catalog.workers:
        raise CatalogError(f"{path}: no machine type can run workers: give one gpu_count >= 1 (with gpu_kind, gpu_memory_gib, gpu_speed)")
    if not catalog.nodes:
        raise CatalogError(f'{path}: no machine type can run optimizer nodes: add one without GPUs, or roles = ["worker", "node"]')
    return catalog


@dataclass(frozen=True, slots=True)
class _Where:
    path: str
    text: str
    start: int  # the table's header line (1-based)
    end: int | None  # the next table's header line

    def line(self, key: str) -> int:
        lines = self.text.splitlines()[self.start : (self.end - 1) if self.end else None]
        pattern = re.compile(rf"^[ \t]*[\"']?{re.escape(key)}[\"']?[ \t]*=")
        return next((self.start + 1 + i for i, line in enumerate(lines) if pattern.match(line)), self.start)

    def error(self, key: str, message: str) -> CatalogError:
        return CatalogError(f"{self.path}:{self.line(key)}: {message}")


def _top_line(text: str, key: str) -> int:
    match = re.search(rf"^[ \t]*(\[\[?[ \t]*)?{re.escape(key)}\b", text, re.MULTILINE)
    return text.count("\n", 0, match.start()) + 1 if match else 0


def _number(table: dict[str, Any], key: str, where: _Where, label: str, *, positive: bool = False, integer: bool = False) -> Any:
    value = table[key]
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or (isinstance(value, float) and not math.isfinite(value)):
        raise where.error(key, f"{label}: {key} must be {'an integer' if integer else 'a number'}, not {value!r}")
    if value < 0 or (positive and value == 0):
        raise where.error(key, f"{label}: {key} must be {'> 0' if positive else '>= 0'}, not {value!r}")
    return value


def _machine(table: dict[str, Any], where: _Where) -> MachineType:
    name = table.get("name")
    label = f"machine {name!r}" if isinstance(name, str) and name else f"the [[machine]] on line {where.start}"
    for key in table:
        if key not in _REQUIRED + _OPTIONAL:
            raise where.error(key, f"{label}: unknown key {key!r}; a machine takes {', '.join(_REQUIRED + _OPTIONAL)}")
    for key in _REQUIRED:
        if key not in table:
            raise CatalogError(f"{where.path}:{where.start}: {label}: missing key {key!r}")
    if not isinstance(name, str) or not name.strip():
        raise where.error("name", f"{label}: name must be a non-empty string, not {name!r}")
    values: dict[str, Any] = {"name": name, "line": where.start}
    for key in ("price_per_hour", "memory_gib"):
        values[key] = float(_number(table, key, where, label))
    values["network_gbps"] = float(_number(table, "network_gbps", where, label, positive=True))
    values["cpu_cores"] = _number(table, "cpu_cores", where, label, positive=True, integer=True)
    if "network_latency_us" in table:
        values["network_latency_us"] = float(_number(table, "network_latency_us", where, label))
    if "spot_price_per_hour" in table:
        values["spot_price_per_hour"] = float(_number(table, "spot_price_per_hour", where, label))
        if "spot_preemptions_per_hour" not in table:
            raise where.error("spot_price_per_hour", f"{label}: a spot price needs spot_preemptions_per_hour (0 if never)")
        values["spot_preemptions_per_hour"] = float(_number(table, "spot_preemptions_per_hour", where, label))
    elif "spot_preemptions_per_hour" in table:
        raise where.error("spot_preemptions_per_hour", f"{label}: spot_preemptions_per_hour without a spot_price_per_hour")
    gpus = _number(table, "gpu_count", where, label, integer=True) if "gpu_count" in table else 0
    values["gpu_count"] = gpus
    if gpus:
        for key in _GPU_KEYS:
            if key not in table:
                raise where.error("gpu_count", f"{label}: gpu_count = {gpus} needs {key} too")
        if not isinstance(table["gpu_kind"], str):
            raise where.error("gpu_kind", f"{label}: gpu_kind must be a string, not {table['gpu_kind']!r}")
        values["gpu_kind"] = table["gpu_kind"]
        values["gpu_memory_gib"] = float(_number(table, "gpu_memory_gib", where, label, positive=True))
        values["gpu_speed"] = float(_number(table, "gpu_speed", where, label, positive=True))
    else:
        for key in _GPU_KEYS:
            if key in table:
                raise where.error(key, f"{label}: {key} without gpu_count >= 1")
    roles = table.get("roles", [WORKER] if gpus else [NODE])
    if not isinstance(roles, list) or not roles or any(r not in (WORKER, NODE) for r in roles):
        raise where.error("roles", f'{label}: roles must be a list of "worker" and/or "node", not {roles!r}')
    if WORKER in roles and not gpus:
        raise where.error("roles", f'{label}: a worker needs a GPU: give gpu_count >= 1 or leave "worker" out of roles')
    values["roles"] = tuple(dict.fromkeys(roles))
    return MachineType(**values)
