"""scripts/cuda_checks.sh: valid and shellcheck-clean bash that runs the CUDA tests and then
``netoptim bench gpu``, writing its logs and report; on a machine without CUDA the tests skip and the
report says why there is no figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "cuda_checks.sh"


def test_shellcheck():
    result = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.slow  # two Python start-ups with torch and a pytest run: ~10-20 s
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the whole benchmark: minutes")
def test_without_cuda_it_writes_the_logs_and_a_report_without_a_figure(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)  # the script calls python3: this interpreter
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "TESTS_TIMEOUT_S": "120", "BENCH_TIMEOUT_S": "120"}
    env["THEN_BENCH"] = "--sizes 1b --dtypes float32 --modes full,layerwise --pin --nodes 2; --modes full --node-arg=--pass-thread"  # two variants
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "compiled update loop usable: True" in result.stdout and "kernels compiled or loaded in" in result.stdout
    assert "tests exit status: 0" in result.stdout and "bench exit status: 0" in result.stdout
    assert "variant-1 exit status: 0" in result.stdout and "variant-2 exit status: 0" in result.stdout
    assert "skipped" in (tmp_path / "out" / "tests.log").read_text()
    for name in ("gpu.json", "gpu-then-1.json", "gpu-then-2.json"):
        report = json.loads((tmp_path / "out" / name).read_text())
        assert report["ratio"] is None and "no CUDA device" in report["status"]
