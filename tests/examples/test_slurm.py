"""examples/slurm/train_gpt.sbatch: valid bash, and run whole against stand-ins for Slurm
(``srun``, ``scontrol``) and for ``netoptim`` and ``torchrun`` that record their command lines,
which are then checked against the real parsers; the host file it writes is one
:func:`gpu_worker.discovery.resolve_nodes` reads."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from gpu_worker.discovery import resolve_nodes
from tests.examples.commands import check_netoptim, check_torchrun

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "slurm" / "train_gpt.sbatch"
IMAGE = "netoptim-train:0.2.0"
"""The image the script runs by default (tests/packaging checks that the Dockerfile builds this tag)."""

# Stand-ins, on PATH before the real commands. Each records its arguments, NUL-separated, in
# $RECORDS/<command>.<pid>. srun runs its command once per host of the het group it is given,
# with SLURM_PROCID set, and passes SIGTERM on; the netoptim stand-in writes its ready file and
# waits for SIGTERM, like a node.
STUBS = {
    "scontrol": """#!/bin/bash
[[ $1 == show && $2 == hostnames ]] || exit 2
tr ',' '\\n' <<<"$3"
""",
    "srun": """#!/bin/bash
printf '%s\\0' "$@" >"$RECORDS/srun.$$"
while [[ $1 == -* ]]; do [[ $1 == --het-group=* ]] && group=${1#--het-group=}; shift; done
var=SLURM_JOB_NODELIST_HET_GROUP_$group
IFS=, read -ra hosts <<<"${!var}"
pids=()
for i in "${!hosts[@]}"; do SLURM_PROCID=$i SLURMD_NODENAME=${hosts[$i]} "$@" & pids+=($!); done
trap 'kill -TERM "${pids[@]}"' TERM
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
wait
exit $status
""",
    "netoptim": """#!/bin/bash
printf '%s\\0' "$@" >"$RECORDS/netoptim.$$"
[[ $1 == node ]] || exit 0
args=("$@")
for i in "${!args[@]}"; do [[ ${args[$i]} == --ready-file ]] && ready=${args[$((i + 1))]}; done
echo '{"data": "tcp://0.0.0.0:5555"}' >"$ready"
sleep 600 &
trap 'kill $!; exit 0' TERM
wait
""",
    "torchrun": """#!/bin/bash
printf '%s\\0' "$@" >"$RECORDS/torchrun.$$"
""",
}


def recorded(records: Path, command: str) -> list[list[str]]:
    return [path.read_bytes().decode().split("\0")[:-1] for path in sorted(records.glob(f"{command}.*"))]


def test_bash_syntax():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_shellcheck():
    result = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("image", [None, ""], ids=["image", "host-installation"])
def test_batch_script_runs_with_real_command_lines(tmp_path, image):
    """``image``: NETOPTIM_IMAGE, unset (the default image, run by pyxis) or empty (the hosts' own netoptim)."""
    bin_dir, records, job_dir = tmp_path / "bin", tmp_path / "records", tmp_path / "job"
    for directory in (bin_dir, records, job_dir / "keys" / "allowed"):
        directory.mkdir(parents=True)
    for name, text in STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    for key in ("node.key", "node.key_secret"):
        (job_dir / "keys" / key).write_text("stand-in\n")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "RECORDS": str(records),
        "NETOPTIM_JOB_DIR": str(job_dir),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "cpu-a,cpu-b",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "gpu-a,gpu-b",
        "SLURM_CPUS_PER_TASK": "32",
    }
    env.pop("NETOPTIM_IMAGE", None)
    if image is not None:
        env["NETOPTIM_IMAGE"] = image
    result = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    run_dir = job_dir / "run-4242"
    assert "optimizer nodes ready: tcp://cpu-a:5555 tcp://cpu-b:5555" in result.stdout

    # The host file: the CPU hosts in Slurm's order, read as the workers' rank 0 reads it.
    assert resolve_nodes(run_dir / "nodes.txt", environ={}).addresses == ("tcp://cpu-a:5555", "tcp://cpu-b:5555")

    nodes = sorted(recorded(records, "netoptim"), key=lambda argv: argv[argv.index("--node-id") + 1])
    assert len(nodes) == 2
    for index, argv in enumerate(nodes):
        args = check_netoptim(argv)
        assert args.command == "node" and args.listen == "tcp://0.0.0.0:5555" and args.node_id == f"node{index}"
        assert args.curve_secret_key and args.curve_allow, "nodes reachable from the network need CURVE"
        assert args.checkpoint_dir == str(job_dir / "checkpoints" / f"node{index}") and args.resume
        assert Path(args.checkpoint_dir).is_dir(), "--resume needs the checkpoint directory to exist"
        assert args.ready_file == str(run_dir / "ready" / f"node{index}.json")
        assert args.admin.startswith("127.0.0.1:") and args.metrics_port == 9400 and args.threads == 32

    (torchrun,) = {tuple(argv) for argv in recorded(records, "torchrun")}  # the same on every GPU host
    assert len(recorded(records, "torchrun")) == 2
    launcher, recipe = check_torchrun(torchrun)
    assert launcher.nnodes == "2" and launcher.nproc_per_node == "8" and launcher.rdzv_backend == "c10d"
    assert launcher.rdzv_endpoint == "gpu-a:29500"
    assert recipe.nodes == str(run_dir / "nodes.txt")  # a host file: rank 0 reads it and shares the list
    assert recipe.global_batch % (2 * 8) == 0
    assert recipe.curve_secret_key.endswith("worker{rank}.key_secret") and recipe.curve_server_key.endswith("node.key")

    # Both steps target the right component; the nodes were stopped with SIGTERM at the end.
    groups = sorted(next(a for a in argv if a.startswith("--het-group=")) for argv in recorded(records, "srun"))
    assert groups == ["--het-group=0", "--het-group=1"]

    # Both steps run in the image (pyxis' flags), with the job directory at the same path, or both
    # on the hosts' own installation.
    for argv in recorded(records, "srun"):
        options = argv[: next(i for i, arg in enumerate(argv) if not arg.startswith("-"))]
        container = sorted(option for option in options if option.startswith("--container-"))
        if image is None:
            assert container == [f"--container-image={IMAGE}", f"--container-mounts={job_dir}:{job_dir}"]
        else:
            assert container == []
