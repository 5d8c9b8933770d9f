#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go: the CUDA tests, then `netoptim bench gpu`.
# Usage: scripts/cuda_checks.sh OUT_DIR [bench gpu flags...]
# Writes OUT_DIR/tests.log, OUT_DIR/bench.log and OUT_DIR/gpu.json (kept up to date after every mode).
# TESTS_TIMEOUT_S and BENCH_TIMEOUT_S bound each part (default 240 and 600 seconds).
# THEN_BENCH="flags" runs `netoptim bench gpu` a second time with those flags (a variant to compare,
# e.g. "--sizes 1b --dtypes float32 --modes full,layerwise --pin --nodes 2"), into OUT_DIR/gpu-then.json
# and OUT_DIR/bench-then.log, bounded by THEN_TIMEOUT_S (default 300 seconds).
set -u -o pipefail
out=${1:?usage: scripts/cuda_checks.sh OUT_DIR [bench gpu flags...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
PY
# On a time-out, SIGABRT: faulthandler writes every thread's stack into the log (a test, or the
# interpreter's exit, that hangs says where).
timeout -s ABRT -k 10 "${TESTS_TIMEOUT_S:-240}" python3 -X faulthandler -m pytest -p no:cacheprovider -q -o addopts="" -m "not slow" \
    tests/gpu_worker/test_cuda_path.py tests/gpu_worker/test_device_spelling.py 2>&1 | tee "$out/tests.log" | tail -25
echo "tests exit status: $?"
timeout "${BENCH_TIMEOUT_S:-600}" python3 -m netoptim bench gpu --out "$out/gpu.json" "$@" 2>&1 | tee "$out/bench.log" | grep -v -i warn | tail -60
echo "bench exit status: $?"
if [ -n "${THEN_BENCH:-}" ]; then
    # shellcheck disable=SC2086  # the flags are words
    timeout "${THEN_TIMEOUT_S:-300}" python3 -m netoptim bench gpu --out "$out/gpu-then.json" $THEN_BENCH 2>&1 | tee "$out/bench-then.log" | grep -v -i warn | tail -40
    echo "second bench exit status: $?"
fi
