"""The two example scripts, run as their docstrings say (``torchrun --standalone --nproc-per-node 2``,
one node on loopback) for a few steps each, then once more with ``--resume``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.integrations.common import ROOT, start_nodes


@pytest.mark.slow  # ~60 s: two torchrun launches per example
def test_the_examples_train_and_resume(tmp_path):
    node = start_nodes(tmp_path, ["node"])["node"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    try:
        for script, extra in (("train_hf_trainer.py", ["--save-steps", "4"]), ("train_lightning.py", [])):
            out = tmp_path / script.removesuffix(".py")
            for steps, resume in ((4, []), (6, ["--resume"])):
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", f"examples/{script}"]
                command += ["--nodes", node.address, "--steps", str(steps), "--batch-size", "4", "--output-dir", str(out), *extra, *resume]
                result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
                assert result.returncode == 0, f"{script} {resume}: {result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        assert (tmp_path / "train_hf_trainer" / "checkpoint-6" / "optimizer.pt").is_file()
        assert (tmp_path / "train_lightning" / "last.ckpt").is_file()
    finally:
        assert node.stop() == 0, node.log_text()[-3000:]
    assert "finished at step 6" in node.log_text()
