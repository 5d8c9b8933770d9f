#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go: the CUDA tests, then `netoptim bench gpu`.
# Usage: scripts/cuda_checks.sh OUT_DIR [bench gpu flags...]
# Writes OUT_DIR/tests.log, OUT_DIR/bench.log and OUT_DIR/gpu.json (kept up to date after every mode).
# TESTS_TIMEOUT_S and BENCH_TIMEOUT_S bound each part (default 240 and 600 seconds).
# THEN_BENCH="flags" runs `netoptim bench gpu` again with those flags (a variant to compare, e.g.
# "--sizes 1b --dtypes float32 --modes full --no-limits --node-arg=--pass-thread"), into
# OUT_DIR/gpu-then.json and OUT_DIR/bench-then.log, bounded by THEN_TIMEOUT_S (default 300 seconds).
# Several variants: separate them with ';' (OUT_DIR/gpu-then-1.json, -2, ... in that order), each
# bounded by THEN_TIMEOUT_S.
set -u -o pipefail
out=${1:?usage: scripts/cuda_checks.sh OUT_DIR [bench gpu flags...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
PY
# The node's compiled kernels first, timed (numba caches them on disk): on a fresh machine this takes
# tens of seconds, which the test session would otherwise spend at its start, outside pytest's clock.
start=$(date +%s)
python3 -c "from optimizer_node import compiled_update; print('compiled update loop usable:', compiled_update.usable())"
echo "kernels compiled or loaded in $(( $(date +%s) - start )) s"
# On a time-out, SIGABRT: faulthandler writes every thread's stack into the log (a test, or the
# interpreter's exit, that hangs says where).
timeout -s ABRT -k 10 "${TESTS_TIMEOUT_S:-240}" python3 -X faulthandler -m pytest -p no:cacheprovider -q -o addopts="" -m "not slow" \
    tests/gpu_worker/test_cuda_path.py tests/gpu_worker/test_device_spelling.py 2>&1 | tee "$out/tests.log" | tail -25
echo "tests exit status: $?"
timeout "${BENCH_TIMEOUT_S:-600}" python3 -m netoptim bench gpu --out "$out/gpu.json" "$@" 2>&1 | tee "$out/bench.log" | grep -v -i warn | tail -60
echo "bench exit status: $?"
if [ -n "${THEN_BENCH:-}" ]; then
    IFS=';' read -r -a variants <<< "$THEN_BENCH"
    for index in "${!variants[@]}"; do
        suffix=$([ "${#variants[@]}" -gt 1 ] && echo "-$((index + 1))" || true)
        echo "variant${suffix}: ${variants[$index]}"
        # shellcheck disable=SC2086  # the flags are words
        timeout "${THEN_TIMEOUT_S:-300}" python3 -m netoptim bench gpu --out "$out/gpu-then${suffix}.json" ${variants[$index]} 2>&1 \
            | tee "$out/bench-then${suffix}.log" | grep -v -i warn | tail -40
        echo "variant${suffix} exit status: $?"
    done
fi
