"""Whether a node's large tensors live in transparent huge pages (``--huge-pages``): the choice, a
fresh interpreter's tensors where it is made before torch loads, and what a real node says of it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from netoptim.launch import huge_pages
from netoptim.launch.huge_pages import THP_ENV, anonymous_huge_pages, apply_huge_pages

HUGE_PAGES_PROBE = """
import sys
from netoptim.launch.huge_pages import apply_huge_pages
apply_huge_pages(sys.argv[1] == "on")
import torch
values = torch.empty(16 << 20)  # 64 MiB, written: resident
values.fill_(1.0)
with open("/proc/self/smaps_rollup") as rollup:
    print(next(int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages:")))
"""


def test_the_choice_is_set_for_torch_unless_the_environment_made_it(monkeypatch, tmp_path):
    policy = tmp_path / "enabled"
    policy.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "ANONYMOUS_HUGE_PAGES", str(policy))
    assert anonymous_huge_pages() == "madvise"
    environ: dict[str, str] = {}
    assert apply_huge_pages(True, environ, torch_loaded=False) == "on (--huge-pages; the host's transparent huge pages: madvise)" and environ == {THP_ENV: "1"}
    environ = {}
    assert apply_huge_pages(False, environ, torch_loaded=False) == "off (--no-huge-pages)" and environ == {THP_ENV: "0"}
    environ = {THP_ENV: "0"}
    assert apply_huge_pages(True, environ, torch_loaded=False) == f"off (as {THP_ENV}=0 in the environment says)" and environ == {THP_ENV: "0"}
    policy.write_text("always madvise [never]\n")
    said = apply_huge_pages(True, {}, torch_loaded=False)
    assert said.startswith("asked for (--huge-pages) but not granted") and "'madvise' grants them" in said
    policy.unlink()
    assert anonymous_huge_pages() is None and "is not there" in apply_huge_pages(True, {}, torch_loaded=False)


@pytest.mark.parametrize("choice", ["on", "off"])
def test_a_fresh_interpreter_gets_huge_pages_for_large_tensors_where_the_host_grants_them(choice, monkeypatch):
    monkeypatch.delenv(THP_ENV, raising=False)
    out = subprocess.run([sys.executable, "-c", HUGE_PAGES_PROBE, choice], capture_output=True, text=True, timeout=120, check=True)
    huge_kib = int(out.stdout.split()[-1])
    policy = anonymous_huge_pages()
    if policy == "always" or (choice == "on" and policy == "madvise"):
        assert huge_kib >= 32 << 10, f"{huge_kib} KiB of 64 MiB in huge pages with {choice} and the host's {policy}"
    else:
        assert huge_kib == 0, f"{huge_kib} KiB in huge pages with {choice} and the host's {policy}"


def test_asking_after_torch_loaded_says_it_is_too_late():
    assert "torch" in sys.modules  # this test process's
    said = apply_huge_pages(True, {})
    assert said.startswith("asked for (--huge-pages) too late") and f"{THP_ENV}=1" in said


@pytest.mark.parametrize("given", ["yes", " 1", "2"])
def test_a_value_torch_ignores_is_said_to_leave_huge_pages_off(given):
    environ = {THP_ENV: given}
    said = apply_huge_pages(True, environ, torch_loaded=False)
    assert said.startswith("off (") and "which torch ignores" in said and environ == {THP_ENV: given}
