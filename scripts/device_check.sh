#!/usr/bin/env bash
# One device call: build the kernels, run the GPU tests (plain, then under compute-sanitizer
# memcheck and racecheck), then the benchmarks. Prints a short table last; JSON goes under $OUT.
#   usage (on the GPU machine, repo root):  bash scripts/device_check.sh [tests|bench|all] [pytest -k expr]
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
select=${2:-}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MINFER_BUILD_DIR=${MINFER_BUILD_DIR:-/tmp/minfer-build}
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader
start=$(date +%s)
python3 -m minfer.ops --build || exit 1
echo "build: $(( $(date +%s) - start )) s"

kargs=(); [ -n "$select" ] && kargs=(-k "$select")
if [ "$what" = tests ] || [ "$what" = all ]; then
    python3 -m pytest -q -x tests "${kargs[@]}" 2>&1 | tail -n 25 | tee "$OUT/pytest.txt" || status=1
    gpu_tests=$(grep -l requires_cuda tests/test_*.py | tr '\n' ' ')
    for tool in memcheck racecheck; do
        compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
            python3 -m pytest -q -x $gpu_tests "${kargs[@]}" > "$OUT/sanitizer-$tool.txt" 2>&1
        rc=$?; echo "compute-sanitizer $tool: exit $rc ($(grep -c 'ERROR SUMMARY: 0 errors' "$OUT/sanitizer-$tool.txt") clean summaries)"
        tail -n 3 "$OUT/sanitizer-$tool.txt"
        [ $rc -eq 0 ] || status=1
    done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    python3 apps/benchmark.py --suite all --json "$OUT/benchmark.json" --plot "$OUT/benchmark.png" || status=1
fi
exit $status
