#!/usr/bin/env bash
# One device call: build the kernels, run every test on the GPU, the kernel tests under
# compute-sanitizer (memcheck on the tests marked memcheck, less memcheck_skip; racecheck on those
# marked racecheck, about one case per shared-memory kernel: racecheck is ~100x slower; the markers
# are registered in pyproject.toml), the benchmarks, and the generate CLI. Logs and JSON go under
# $OUT; a short summary is printed last. Each of tests, sanitize and bench fits one 10-minute device
# call; all runs the three.
#   usage (GPU machine, repo root; no .git there, so pass the commit):
#     MINFER_COMMIT=<sha> [WORKERS=4] bash scripts/device_check.sh [all|tests|sanitize|bench]
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
case "$what" in all|tests|sanitize|bench) ;; *) echo "usage: device_check.sh [all|tests|sanitize|bench]" >&2; exit 2 ;; esac
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MINFER_BUILD_DIR=${MINFER_BUILD_DIR:-/tmp/minfer-build}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
# Packages the device image lacks (gguf) travel as wheels in .whl/, named in the call's carry; fetch them here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf==0.19.0
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/minfer-site .whl/*.whl || exit 1
    export PYTHONPATH=$PYTHONPATH:/tmp/minfer-site
fi
summary=()
failed=0
note() { summary+=("$1"); echo "$1"; }
# record LABEL STATUS [DETAIL]: notes the step's exit status; any non-zero one fails the whole run.
record() { [ "$2" -eq 0 ] || failed=1; note "$1: exit $2${3:+ | $3}"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
start=$(date +%s)
python3 -m minfer.ops --build || { echo "build failed" >&2; exit 1; }
note "build: $(( $(date +%s) - start )) s"

if [ "$what" = tests ] || [ "$what" = all ]; then
    parallel=(-p no:cacheprovider)  # plus pytest-xdist where installed (the device images have it)
    limit=900
    python3 -c "import xdist" 2>/dev/null && parallel+=(-n "${WORKERS:-4}") && limit=480
    timeout "$limit" python3 -m pytest "${parallel[@]}" tests > "$OUT/pytest.txt" 2>&1
    rc=$?; record "pytest (GPU)" $rc "$(tail -n 1 "$OUT/pytest.txt")"
fi
if [ "$what" = sanitize ] || [ "$what" = all ]; then
    timeout 260 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 10 \
        python3 -m pytest -x -p no:cacheprovider tests -m "memcheck and not memcheck_skip" > "$OUT/memcheck.txt" 2>&1
    rc=$?; record "memcheck" $rc "$(grep 'ERROR SUMMARY' "$OUT/memcheck.txt" | tail -n 1) | $(tail -n 1 "$OUT/memcheck.txt")"
    timeout 200 compute-sanitizer --tool racecheck --error-exitcode 9 --print-limit 10 \
        python3 -m pytest -x -p no:cacheprovider tests -m racecheck > "$OUT/racecheck.txt" 2>&1
    rc=$?; record "racecheck" $rc "$(grep 'RACECHECK SUMMARY' "$OUT/racecheck.txt" | tail -n 1) | $(tail -n 1 "$OUT/racecheck.txt")"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    timeout 300 python3 apps/benchmark.py --suite all --json "$OUT/benchmark.json" --plot "$OUT/benchmark.png" \
        > "$OUT/benchmark.txt" 2>&1
    rc=$?; record "benchmark" $rc
    # issue #4's kernel table: SpMV against cuBLAS, torch CSR and the reference kernel's schedule, SpMM, decompression
    timeout 200 python3 apps/benchmark.py --suite macko --densities 0.1,0.3,0.5,0.7 --json "$OUT/macko.json" \
        > "$OUT/macko.txt" 2>&1
    rc=$?; record "benchmark --suite macko" $rc
    timeout 200 python3 apps/benchmark.py --suite attention --phases prefill --json "$OUT/attention.json" \
        --plot "$OUT/attention.png" > "$OUT/attention.txt" 2>&1
    rc=$?; record "benchmark --suite attention" $rc
    # issue 32's decode rows (block-sparse vs dense SDPA and Flex decode) and its 32k end-to-end row
    timeout 120 python3 apps/benchmark.py --suite attention --phases decode --json "$OUT/attention-decode.json" \
        > "$OUT/attention-decode.txt" 2>&1
    rc=$?; record "benchmark --suite attention --phases decode" $rc
    timeout 150 python3 apps/benchmark.py --suite e2e --context 32768 --new-tokens 128 --attention blocksparse \
        --layout sink-window:sink=128,window=2048 --json "$OUT/e2e-32k.json" > "$OUT/e2e-32k.txt" 2>&1
    rc=$?; record "benchmark --suite e2e --context 32768 (block-sparse)" $rc "$(grep -E 'decode' "$OUT/e2e-32k.txt" | tail -n 2 | tr -s ' ' | tr '\n' ' ')"
    # issue 34's table: the 2:4 GEMV and prefill against cuBLAS, minfer dense and cuSPARSELt, decode beside MACKO
    timeout 200 python3 apps/benchmark.py --suite sparse24 --new-tokens 64 --json "$OUT/sparse24.json" \
        > "$OUT/sparse24.txt" 2>&1
    rc=$?; record "benchmark --suite sparse24" $rc
    for sparse in none macko 2:4; do
        log="$OUT/generate-${sparse/:/-}.txt"  # names that come back from the device: no colon
        timeout 120 python3 apps/generate.py --model llama2-7b --weights random --device cuda --dtype float16 \
            --max-new-tokens 256 --sparse "$sparse" $([ "$sparse" = macko ] && echo --density 0.5) > "$log" 2>&1
        rc=$?; record "generate --sparse $sparse" $rc "$(grep -E 'tok/s' "$log" | tail -n 1)"
    done
    sed -n '/kernels (/,$p' "$OUT/benchmark.txt" | grep -E "end to end|MACKO end|llama2-7b" || true
    sed -n '/MACKO spmv/,/MACKO spmm/p' "$OUT/macko.txt" | grep -E "MACKO spmv|shape|0\.5 " || true
fi
printf '%s\n' "---- summary" "${summary[@]}"
[ "$failed" -eq 0 ] || echo "FAILED: a step above exited non-zero"
exit "$failed"
