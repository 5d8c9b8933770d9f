"""The GPT recipe's paced pushes and overlapped forwards: the same training as without them, and their flags checked."""

from __future__ import annotations

import re

import pytest

from netoptim.launch.processes import NodeProcess, run_workers
from netoptim.recipes.train_gpt import main as recipe_main

SCRIPT = ["--steps", "6", "--n-layer", "1", "--n-embd", "64", "--block-size", "32", "--sample-tokens", "0", "--seed", "3", "--bucket-numel", "4096"]


def train(tmp_path, name: str, *flags: str, capfd) -> str:
    with NodeProcess(tmp_path, name=name) as node:
        status = run_workers(["--nodes", node.address, *SCRIPT, *flags], 2)
    out = capfd.readouterr().out
    assert status == 0, out
    match = re.search(r"loss: [\d.]+ at the start -> [\d.]+ at the end", out)
    assert match, out
    return match.group(0)


@pytest.mark.slow  # three 2-worker recipe runs; the bitwise oracles are tests/gpu_worker/test_oracle.py's paced and overlapped cases
def test_paced_pushes_and_overlapped_forwards_train_as_pushes_at_step(tmp_path, capfd):
    plain = train(tmp_path, "plain", capfd=capfd)
    paced = train(tmp_path, "paced", "--push-during-backward", "--pace-window-kib", "4", capfd=capfd)  # a window below one bucket: every push waits
    assert paced == plain
    assert train(tmp_path, "overlapped", "--overlap-forward", capfd=capfd) == plain
    assert train(tmp_path, "let-go", "--overlap-forward", "--no-keep-step-gradients", capfd=capfd) == plain


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--pace-window-kib", "4"], "needs --push-during-backward"),
        (["--layerwise", "--push-during-backward"], "are for the full model"),
        (["--layerwise", "--overlap-forward"], "are for the full model"),
        (["--layerwise", "--no-keep-step-gradients"], "are for the full model"),
    ],
)
def test_pacing_flags_that_cannot_work_are_refused(flags, message):
    with pytest.raises(SystemExit, match=message):
        recipe_main(["--nodes", "tcp://127.0.0.1:9", *SCRIPT, *flags])
