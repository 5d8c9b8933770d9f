"""The machine catalog of the cost planner: the example loads, and every mistake is named by file, line and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from netoptim.planning.catalog import CatalogError, load_catalog, parse_catalog

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "machines.toml"

GOOD = """\
note = "illustrative"
[[machine]]
name = "gpu"
price_per_hour = 2.0
spot_price_per_hour = 0.8
spot_preemptions_per_hour = 0.1
cpu_cores = 8
memory_gib = 64
gpu_kind = "A"
gpu_count = 4
gpu_memory_gib = 24
gpu_speed = 50.0
network_gbps = 25

[[machine]]
name = "cpu"
price_per_hour = 0.5
cpu_cores = 16
memory_gib = 128
network_gbps = 25
"""


def test_the_example_catalog_loads_and_says_its_prices_are_illustrative():
    catalog = load_catalog(EXAMPLE)
    assert "illustrative" in catalog.note and catalog.currency == "USD"
    assert catalog.workers and catalog.nodes
    assert all(m.gpu_count >= 1 and m.gpu_speed > 0 for m in catalog.workers)
    assert all(m.gpu_count == 0 for m in catalog.nodes)
    spot = [m for m in catalog.machines if m.spot_price_per_hour is not None]
    assert spot and all(m.spot_price_per_hour < m.price_per_hour for m in spot)


def test_a_catalog_splits_machines_by_role_and_prices_spot():
    catalog = parse_catalog(GOOD, "c.toml")
    (gpu,) = catalog.workers
    (cpu,) = catalog.nodes
    assert gpu.name == "gpu" and gpu.line == 2 and cpu.line == 15
    assert gpu.price(spot=True) == 0.8 and gpu.price(spot=False) == 2.0
    assert gpu.network_bytes_per_s == 25e9 / 8 and cpu.memory_bytes == 128 << 30
    with pytest.raises(ValueError, match="no spot price"):
        cpu.price(spot=True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("cpu_cores = 16", "cpu_cores = 16\nspeed = 3"), r"c\.toml:19: machine 'cpu': unknown key 'speed'"),
        (("network_gbps = 25\n\n", "\n\n"), r"c\.toml:2: machine 'gpu': missing key 'network_gbps'"),
        (("cpu_cores = 16", 'cpu_cores = "many"'), r"c\.toml:18: machine 'cpu': cpu_cores must be an integer"),
        (("price_per_hour = 0.5", "price_per_hour = -0.5"), r"c\.toml:17: machine 'cpu': price_per_hour must be >= 0"),
        (("spot_preemptions_per_hour = 0.1\n", ""), r"c\.toml:5: machine 'gpu': a spot price needs spot_preemptions_per_hour"),
        (("gpu_speed = 50.0\n", ""), r"c\.toml:10: machine 'gpu': gpu_count = 4 needs gpu_speed"),
        (('name = "cpu"', 'name = "gpu"'), r"c\.toml:15: name 'gpu' is used twice \(first on line 2\)"),
        (('name = "cpu"', 'name = "cpu"\nroles = ["worker"]'), r"c\.toml:17: machine 'cpu': a worker needs a GPU"),
        (("note =", "notes ="), r"c\.toml:1: unknown key 'notes'"),
        (('[[machine]]\nname = "cpu"', '[machine]\nname = "cpu"'), r"c\.toml: not valid TOML"),
    ],
)
def test_mistakes_are_named_by_file_line_and_key(change, message):
    old, new = change
    assert old in GOOD
    with pytest.raises(CatalogError, match=message):
        parse_catalog(GOOD.replace(old, new, 1), "c.toml")


def test_a_catalog_without_node_or_worker_machines_says_what_to_add(tmp_path):
    workers_only = GOOD[: GOOD.index('\n[[machine]]\nname = "cpu"')]
    with pytest.raises(CatalogError, match="no machine type can run optimizer nodes"):
        parse_catalog(workers_only, "c.toml")
    with pytest.raises(CatalogError, match="cannot read the catalog"):
        load_catalog(tmp_path / "missing.toml")
