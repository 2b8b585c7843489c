#!/usr/bin/env bash
# One device call: build the kernels, run every test on the GPU, the kernel tests under
# compute-sanitizer (memcheck on the tests marked memcheck, less memcheck_skip; racecheck on those
# marked racecheck, about one case per shared-memory kernel: racecheck is ~100x slower; the markers
# are registered in pyproject.toml), the benchmarks, and the generate CLI. Logs and JSON go under
# $OUT; a short summary is printed last. bench measures dense and MACKO (the default suites, the MACKO study,
# generate); backends the other backends' must tables (block-sparse attention prefill and decode and its 32k
# end-to-end row, the 2:4 study, the KS grid and monarch-50 rows, generate --sparse 2:4). Each of tests, sanitize,
# bench and backends is one 10-minute device call (BUDGET_S cuts its last steps short); all runs them in turn.
#   usage (GPU machine, repo root; no .git there, so pass the commit):
#     MINFER_COMMIT=<sha> [WORKERS=4] bash scripts/device_check.sh [all|tests|sanitize|bench|backends]
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
case "$what" in all|tests|sanitize|bench|backends) ;; *)
    echo "usage: device_check.sh [all|tests|sanitize|bench|backends]" >&2; exit 2 ;; esac
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
# Every step's timeout is cut to what is left of BUDGET_S (default: one 10-minute call less the machine's start,
# or an hour for all), so a call returns its summary instead of being killed.
deadline=$(( $(date +%s) + ${BUDGET_S:-$([ "$what" = all ] && echo 3600 || echo 540)} ))
cap() { local left=$(( deadline - $(date +%s) - 10 )); [ "$left" -lt 1 ] && left=1; echo $(( $1 < left ? $1 : left )); }
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
    timeout "$(cap "$limit")" python3 -m pytest "${parallel[@]}" tests > "$OUT/pytest.txt" 2>&1
    rc=$?; record "pytest (GPU)" $rc "$(tail -n 1 "$OUT/pytest.txt")"
fi
if [ "$what" = sanitize ] || [ "$what" = all ]; then
    timeout $(cap 260) compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 10 \
        python3 -m pytest -x -p no:cacheprovider tests -m "memcheck and not memcheck_skip" > "$OUT/memcheck.txt" 2>&1
    rc=$?; record "memcheck" $rc "$(grep 'ERROR SUMMARY' "$OUT/memcheck.txt" | tail -n 1) | $(tail -n 1 "$OUT/memcheck.txt")"
    timeout $(cap 200) compute-sanitizer --tool racecheck --error-exitcode 9 --print-limit 10 \
        python3 -m pytest -x -p no:cacheprovider tests -m racecheck > "$OUT/racecheck.txt" 2>&1
    rc=$?; record "racecheck" $rc "$(grep 'RACECHECK SUMMARY' "$OUT/racecheck.txt" | tail -n 1) | $(tail -n 1 "$OUT/racecheck.txt")"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    timeout $(cap 300) python3 apps/benchmark.py --suite all --json "$OUT/benchmark.json" --plot "$OUT/benchmark.png" \
        > "$OUT/benchmark.txt" 2>&1
    rc=$?; record "benchmark" $rc
    # issue #4's kernel table: SpMV against cuBLAS, torch CSR and the reference kernel's schedule, SpMM, decompression
    timeout $(cap 200) python3 apps/benchmark.py --suite macko --densities 0.1,0.3,0.5,0.7 --json "$OUT/macko.json" \
        > "$OUT/macko.txt" 2>&1
    rc=$?; record "benchmark --suite macko" $rc
    for sparse in none macko; do
        log="$OUT/generate-${sparse/:/-}.txt"  # names that come back from the device: no colon
        timeout $(cap 120) python3 apps/generate.py --model llama2-7b --weights random --device cuda --dtype float16 \
            --max-new-tokens 256 --sparse "$sparse" $([ "$sparse" = macko ] && echo --density 0.5) > "$log" 2>&1
        rc=$?; record "generate --sparse $sparse" $rc "$(grep -E 'tok/s' "$log" | tail -n 1)"
    done
    sed -n '/kernels (/,$p' "$OUT/benchmark.txt" | grep -E "end to end|MACKO end|llama2-7b" || true
    sed -n '/MACKO spmv/,/MACKO spmm/p' "$OUT/macko.txt" | grep -E "MACKO spmv|shape|0\.5 " || true
fi
if [ "$what" = backends ] || [ "$what" = all ]; then
    timeout $(cap 200) python3 apps/benchmark.py --suite attention --phases prefill --json "$OUT/attention.json" \
        --plot "$OUT/attention.png" > "$OUT/attention.txt" 2>&1
    rc=$?; record "benchmark --suite attention" $rc
    # issue 32's decode rows (block-sparse vs dense SDPA and Flex decode) and its 32k end-to-end row
    timeout $(cap 120) python3 apps/benchmark.py --suite attention --phases decode --json "$OUT/attention-decode.json" \
        > "$OUT/attention-decode.txt" 2>&1
    rc=$?; record "benchmark --suite attention --phases decode" $rc
    timeout $(cap 150) python3 apps/benchmark.py --suite e2e --context 32768 --new-tokens 128 --attention blocksparse \
        --layout sink-window:sink=128,window=2048 --json "$OUT/e2e-32k.json" > "$OUT/e2e-32k.txt" 2>&1
    rc=$?; record "benchmark --suite e2e --context 32768 (block-sparse)" $rc "$(grep -E 'decode' "$OUT/e2e-32k.txt" | tail -n 2 | tr -s ' ' | tr '\n' ' ')"
    # issue 34's table: the 2:4 GEMV and prefill against cuBLAS, minfer dense and cuSPARSELt, decode beside MACKO
    timeout $(cap 200) python3 apps/benchmark.py --suite sparse24 --new-tokens 64 --json "$OUT/sparse24.json" \
        > "$OUT/sparse24.txt" 2>&1
    rc=$?; record "benchmark --suite sparse24" $rc
    # issue 33's table: the KS factor grid against dense, einsum and bmm, then monarch-50 end to end
    timeout $(cap 200) python3 apps/benchmark.py --suite ksmm --reps 5 --new-tokens 64 --json "$OUT/ksmm.json" \
        --plot "$OUT/ksmm.png" > "$OUT/ksmm.txt" 2>&1
    rc=$?; record "benchmark --suite ksmm" $rc
    timeout $(cap 120) python3 apps/generate.py --model llama2-7b --weights random --device cuda --dtype float16 \
        --max-new-tokens 256 --sparse 2:4 > "$OUT/generate-2-4.txt" 2>&1
    rc=$?; record "generate --sparse 2:4" $rc "$(grep -E 'tok/s' "$OUT/generate-2-4.txt" | tail -n 1)"
fi
printf '%s\n' "---- summary" "${summary[@]}"
[ "$failed" -eq 0 ] || echo "FAILED: a step above exited non-zero"
exit "$failed"
