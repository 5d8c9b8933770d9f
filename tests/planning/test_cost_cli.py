"""``netoptim plan --calibrate`` and ``--catalog``: a profile measured here, the example catalog
priced with it, and flags that do not go together refused."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.cli import run_netoptim
from tests.planning.test_cost_search import profile

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "machines.toml")


def netoptim(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_netoptim(*args, timeout=timeout)


@pytest.fixture
def profile_file(tmp_path) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile().to_json()))
    return str(path)


def test_the_example_catalog_is_priced_and_the_choice_explained(profile_file):
    table = netoptim("plan", "--catalog", EXAMPLE, "--profile", profile_file, "--global-batch", "16", "--steps", "20000", "--deadline", "24")
    assert table.returncode == 0, table.stderr[-3000:]
    assert "illustrative" in table.stdout and "why #1 (USD):" in table.stdout and "bounded by" in table.stdout
    as_json = netoptim(
        "plan", "--catalog", EXAMPLE, "--profile", profile_file, "--global-batch", "16", "--steps", "20000", "--deadline", "24", "--json", "--top", "3"
    )
    report = json.loads(as_json.stdout)
    options = report["options"]
    assert len(options) == 3 and all(o["hours"] <= 24 for o in options)
    assert [o["cost"] for o in options] == sorted(o["cost"] for o in options)
    budget = netoptim(
        "plan", "--catalog", EXAMPLE, "--profile", profile_file, "--global-batch", "16", "--steps", "20000", "--budget", str(options[0]["cost"]), "--json"
    )
    fastest = json.loads(budget.stdout)["options"]
    assert fastest[0]["hours"] <= options[0]["hours"] and all(o["cost"] <= options[0]["cost"] * (1 + 1e-9) for o in fastest)
    never = netoptim("plan", "--catalog", EXAMPLE, "--profile", profile_file, "--global-batch", "16", "--steps", "20000", "--deadline", "1e-6")
    assert never.returncode != 0 and "no configuration meets the deadline" in never.stderr and "the closest is" in never.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--catalog", EXAMPLE, "--deadline", "5", "--steps", "10"), "--catalog needs --profile"),
        (("--catalog", EXAMPLE, "--profile", "p.json", "--steps", "10"), "exactly one of --deadline HOURS and --budget"),
        (("--catalog", EXAMPLE, "--profile", "p.json", "--deadline", "5"), "--catalog needs --steps"),
        (("--deadline", "5"), "--deadline goes with --catalog"),
        (("--calibrate", "p.json", "--catalog", EXAMPLE), "not both"),
        (("--catalog", EXAMPLE, "--profile", "/nonexistent/p.json", "--deadline", "5", "--steps", "10"), "cannot read the profile"),
        (("--deadline", "-3"), "must be a positive number"),
    ],
)
def test_flags_that_do_not_go_together_are_refused(flags, message):
    result = netoptim("plan", *flags)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_a_bad_catalog_is_named_by_line(tmp_path, profile_file):
    bad = tmp_path / "bad.toml"
    bad.write_text(Path(EXAMPLE).read_text().replace("cpu_cores = 16", "cpu_cores = 16\ncores = 3", 1))
    result = netoptim("plan", "--catalog", str(bad), "--profile", profile_file, "--deadline", "5", "--steps", "10")
    assert result.returncode != 0 and f"{bad}:" in result.stderr and "unknown key 'cores'" in result.stderr


@pytest.mark.slow  # measures a profile of a tiny model here: ~40 s
def test_calibrate_writes_a_profile_the_catalog_planner_reads(tmp_path):
    path = tmp_path / "profile.json"
    model = ("--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--global-batch", "4", "--max-microbatches", "2")
    result = netoptim("plan", *model, "--calibrate", str(path), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"profile written to {path}" in result.stdout
    saved = json.loads(path.read_text())
    assert set(saved["update_pass_s"]) == {"1", "2"} and all(v > 0 for v in saved["update_pass_s"].values())
    assert 0.0 <= saved["thread_efficiency"] <= 1.0 and saved["shared_update_scale"] > 0
    assert saved["pipeline"]["optimizer"]["2"]["node_cpu_per_param_s"] > 0
    planned = netoptim("plan", *model, "--catalog", EXAMPLE, "--profile", str(path), "--steps", "100000", "--deadline", "48", "--json")
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert json.loads(planned.stdout)["options"]
