#!/usr/bin/env bash
# One device call for block-sparse attention: build, its GPU tests, compute-sanitizer memcheck and
# racecheck on a few small cases of each kernel, the attention benchmark; logs and JSON under $OUT,
# a summary last.
#   usage (GPU machine, repo root): [SANITIZE=0] bash scripts/blocksparse_check.sh [LENGTHS]
#   (LENGTHS default 4096,8192,16384,32768)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export MINFER_BUILD_DIR=${MINFER_BUILD_DIR:-/tmp/mb}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
lengths=${1:-4096,8192,16384,32768}
summary=()
record() { summary+=("$1: exit $2${3:+ | $3}"); echo "$1: exit $2"; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
start=$(date +%s)
python3 -m minfer.ops --build > "$OUT/build.txt" 2>&1 || { tail -n 40 "$OUT/build.txt"; exit 1; }
record build 0 "$(( $(date +%s) - start )) s"
tests=tests/test_blocksparse_attention.py
parallel=()
python3 -c "import xdist" 2>/dev/null && parallel=(-n 4)
timeout 150 python3 -m pytest -q -p no:cacheprovider "${parallel[@]}" $tests > "$OUT/pytest.txt" 2>&1
record pytest $? "$(tail -n 1 "$OUT/pytest.txt")"
if [ "${SANITIZE:-1}" != 0 ]; then
    timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 10 python3 -m pytest -q \
        -p no:cacheprovider $tests \
        -k "kernel_matches and (128-200-gqa-128-dtype0 or 64-65-mha-64-dtype1) or zeros_for or strided_views" \
        > "$OUT/memcheck.txt" 2>&1
    record memcheck $? "$(grep 'ERROR SUMMARY' "$OUT/memcheck.txt" | tail -n 1) | $(tail -n 1 "$OUT/memcheck.txt")"
    timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 --print-limit 10 python3 -m pytest -q \
        -p no:cacheprovider $tests -k "kernel_matches and 64-200-gqa-128-dtype0 or zeros_for" \
        > "$OUT/racecheck.txt" 2>&1
    record racecheck $? "$(grep 'RACECHECK SUMMARY' "$OUT/racecheck.txt" | tail -n 1) | $(tail -n 1 "$OUT/racecheck.txt")"
fi
timeout 200 python3 apps/benchmark.py --suite attention --lengths "$lengths" --json "$OUT/attention.json" \
    --plot "$OUT/attention.png" > "$OUT/benchmark.txt" 2>&1
record benchmark $?
grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest.txt" | head -n 20
tail -n 45 "$OUT/benchmark.txt"
printf '%s\n' "${summary[@]}"
