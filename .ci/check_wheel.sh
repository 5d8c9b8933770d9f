#!/usr/bin/env bash
# The distribution as a user gets it: build the sdist and the wheel, check the wheel's contents,
# install it into a fresh virtual environment outside the repository and run it from there: the
# command line, the demo, and a two-worker training of the packaged GPT recipe against a node.
#
# Usage: bash .ci/check_wheel.sh (with the test extra installed: build, check-wheel-contents).
# PYTHON picks the interpreter (default: python); it needs an index that serves setuptools (the build)
# and torch==2.13.0 (the fresh environment). Where torch comes from is pip's own configuration
# (pip.conf, PIP_INDEX_URL), as for .ci/run's install: the CPU build, and from pip's cache after that.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python}
EXPECTED_TOPLEVEL="gpu_worker netoptim optimizer_node protos transport"
STEPS=4 # training steps of the demo and of the recipe: enough to see every path once

WORK=$(mktemp -d "${TMPDIR:-/tmp}/netoptim-wheel.XXXXXX")
NODE_PID=""
STARTED=$SECONDS

cleanup() {
    local status=$?
    if [[ -n $NODE_PID ]] && kill -0 "$NODE_PID" 2>/dev/null; then
        kill -TERM "$NODE_PID" 2>/dev/null || true
        wait "$NODE_PID" 2>/dev/null || true
    fi
    # Anything still running from the fresh environment (a node's kernel compiler outlives a node
    # stopped early): this run's processes only, found by the unique path of its environment.
    local leftover
    leftover=$(pgrep -f -- "$WORK/venv/bin/" || true)
    if [[ -n $leftover ]]; then
        # shellcheck disable=SC2086 # one process id a word
        kill -TERM $leftover 2>/dev/null || true
        sleep 1
    fi
    rm -rf "$WORK"
    echo "check_wheel: removed $WORK at $((SECONDS - STARTED)) s"
    if ((status != 0)); then
        echo "check_wheel: FAILED (exit $status) after $((SECONDS - STARTED)) s" >&2
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

step() { printf '\n==> [%3d s] %s\n' "$((SECONDS - STARTED))" "$*"; }
fail() {
    echo "check_wheel: $*" >&2
    exit 1
}

step "building the sdist and the wheel into $WORK/dist"
"$PYTHON" -m build --outdir "$WORK/dist" "$ROOT" >"$WORK/build.log" 2>&1 || {
    cat "$WORK/build.log" >&2
    fail "python -m build failed"
}
shopt -s nullglob
wheels=("$WORK"/dist/*.whl)
sdists=("$WORK"/dist/*.tar.gz)
shopt -u nullglob
((${#wheels[@]} == 1 && ${#sdists[@]} == 1)) || fail "expected one wheel and one sdist, got: $(ls "$WORK/dist")"
WHEEL=${wheels[0]}
echo "built $(basename "${sdists[0]}") and $(basename "$WHEEL")"

step "check-wheel-contents (configured in pyproject.toml)"
check-wheel-contents --config "$ROOT/pyproject.toml" "$WHEEL"

step "the wheel's top-level import packages, protos/admin.proto and metadata"
"$PYTHON" - "$WHEEL" "$EXPECTED_TOPLEVEL" "$ROOT/netoptim/__init__.py" <<'EOF'
import email.parser
import re
import sys
import zipfile

wheel, expected, init = sys.argv[1], sorted(sys.argv[2].split()), sys.argv[3]
names = zipfile.ZipFile(wheel).namelist()
dist_info = {name.split("/")[0] for name in names if name.split("/")[0].endswith(".dist-info")}
toplevel = sorted({name.split("/")[0] for name in names} - dist_info)
assert toplevel == expected, f"top-level entries {toplevel}, expected exactly {expected}"
for package in toplevel:
    assert f"{package}/__init__.py" in names, f"{package}/ is not an import package (no __init__.py)"
    assert f"{package}/py.typed" in names, f"{package}/ lacks py.typed (the distribution says Typing :: Typed)"
assert "protos/admin.proto" in names, "protos/admin.proto is not in the wheel"
(info,) = dist_info
metadata = email.parser.Parser().parsestr(zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode())
version = re.search(r'^__version__ = "([^"]+)"', open(init).read(), re.M)[1]
assert metadata["Name"] == "netoptim-train", metadata["Name"]
assert metadata["Version"] == version, f"wheel version {metadata['Version']}, netoptim.__version__ {version}"
assert metadata["License-Expression"] == "Apache-2.0", metadata["License-Expression"]
print(f"{metadata['Name']} {metadata['Version']}: {', '.join(toplevel)}; protos/admin.proto; {len(names)} files")
EOF

step "a fresh virtual environment in $WORK/venv (outside the repository)"
cd "$WORK"
# Nothing of the repository or of the calling environment on the new interpreter's path.
unset PYTHONPATH PYTHONHOME VIRTUAL_ENV
"$PYTHON" -m venv "$WORK/venv"
VENV_PYTHON=$WORK/venv/bin/python
# torch first: the CPU build, so that the wheel's "torch>=2.4" is already satisfied.
"$VENV_PYTHON" -m pip install --quiet torch==2.13.0
"$VENV_PYTHON" -m pip install --quiet "$WHEEL"
"$VENV_PYTHON" -m pip check
"$VENV_PYTHON" -m pip list 2>/dev/null | grep -E '^(netoptim-train|torch) '

step "the public API imports from the fresh environment"
"$VENV_PYTHON" - "$WORK/venv" <<'EOF'
import os
import sys

from gpu_worker import RemoteAdamW, offload
from optimizer_node import NodeConfig, NodeDaemon

import netoptim
import protos
import transport

venv = os.path.realpath(sys.argv[1])
for module in (netoptim, protos, transport, sys.modules["gpu_worker"], sys.modules["optimizer_node"]):
    where = os.path.realpath(module.__file__)
    assert where.startswith(venv + os.sep), f"{module.__name__} comes from {where}, not from the fresh environment {venv}"
print(f"netoptim {netoptim.__version__} from {os.path.dirname(netoptim.__file__)}")
print("imported:", ", ".join(item.__name__ for item in (RemoteAdamW, offload, NodeConfig, NodeDaemon)))
EOF

export PATH="$WORK/venv/bin:$PATH"
export OMP_NUM_THREADS=1 # two workers and a node on a small machine: no oversubscription

step "netoptim --version"
version_line=$(netoptim --version)
echo "$version_line"
[[ $version_line == "netoptim "* ]] || fail "unexpected output of netoptim --version: $version_line"

step "compiling the node's update kernels into the fresh environment (about a minute)"
# What a node's first start does in a child process that outlives the node; done here in the
# foreground, so the nodes below find the kernels compiled and leave no child behind.
"$VENV_PYTHON" -m optimizer_node.update.kernels.warmup

step "netoptim demo --steps $STEPS"
netoptim demo --steps "$STEPS" --workers 2

step "a node on a free loopback port"
# Port 0: the node binds a free port and writes the address it got into its ready file.
netoptim node --listen tcp://127.0.0.1:0 --node-id packaged --ready-file "$WORK/node.json" >"$WORK/node.log" 2>&1 &
NODE_PID=$!
for _ in $(seq 600); do
    [[ -s $WORK/node.json ]] && break
    kill -0 "$NODE_PID" 2>/dev/null || {
        cat "$WORK/node.log" >&2
        fail "the node exited before it was ready"
    }
    sleep 0.1
done
[[ -s $WORK/node.json ]] || {
    cat "$WORK/node.log" >&2
    fail "the node is not ready after 60 s"
}
ADDRESS=$("$VENV_PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["data"])' "$WORK/node.json")
echo "node $NODE_PID at $ADDRESS"

step "two workers of the packaged recipe: torchrun -m netoptim.recipes.train_gpt ($STEPS steps)"
# torchrun exits 0 only when every worker did; rank 0 then reports the steps over both workers.
torchrun --standalone --nproc-per-node 2 -m netoptim.recipes.train_gpt \
    --nodes "$ADDRESS" --steps "$STEPS" --sample-tokens 0 2>&1 | tee "$WORK/train.log"
grep -q "^loss: .* $STEPS steps in .* over 2 workers" "$WORK/train.log" || fail "rank 0 did not report $STEPS steps over 2 workers"

step "stopping the node"
kill -TERM "$NODE_PID"
node_status=0
wait "$NODE_PID" || node_status=$?
NODE_PID=""
((node_status == 0)) || {
    cat "$WORK/node.log" >&2
    fail "the node exited with status $node_status on SIGTERM"
}
tail -n 3 "$WORK/node.log"

step "the distribution works from a fresh environment: all checks passed in $((SECONDS - STARTED)) s"
