#!/usr/bin/env bash
# One device call on a host of 2+ GPUs for tensor parallelism (issue 35), inside a time budget: build, the
# device-to-device copy rate, the all-reduce kernel's tests, decode tok/s of llama2-7b at TP 1 and TP 2
# (minfer's one-shot all-reduce and NCCL's), llama2-70b at TP 2 dense and MACKO d = 0.5 (random weights,
# built per rank on its GPU), and the greedy-equality tests on the GPUs. Steps run most important first, each cut to the time left; JSON and logs go
# under $OUT and a summary table is printed last.
#   usage (GPU machine, repo root): BUDGET_S=190 bash scripts/tp_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MINFER_BUILD_DIR=${MINFER_BUILD_DIR:-/tmp/minfer-build}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
deadline=$(( $(date +%s) + ${BUDGET_S:-190} ))
summary=()
note() { summary+=("$1"); echo "$1"; }
# step NAME MAX_S COMMAND...: runs COMMAND with at most MAX_S seconds, less when the budget runs short.
step() {
    local name=$1 limit=$2 left=$(( deadline - $(date +%s) - 5 ))
    shift 2
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then note "$name: skipped (budget spent)"; return; fi
    local start=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    note "$name: exit $? in $(( $(date +%s) - start )) s"
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 2
step build 90 python3 -m minfer.ops --build || true
step copy_rate 20 python3 -c "from minfer.bench.timing import copy_bandwidth_gbs; print(round(copy_bandwidth_gbs(), 1))"
step allreduce_tests 60 python3 -m pytest -x -q -p no:cacheprovider tests/test_allreduce.py
gen=(python3 apps/generate.py --weights random --json --prompt "Tensor parallel" --max-new-tokens 256)
step 7b_tp1 40 "${gen[@]}" --model llama2-7b
step 7b_tp2 45 "${gen[@]}" --model llama2-7b --tp 2
step gpu_tp_tests 110 python3 -m pytest -q -p no:cacheprovider tests/test_parallel.py -k gpus
step 7b_tp2_nccl 45 env MINFER_TP_ALLREDUCE=nccl "${gen[@]}" --model llama2-7b --tp 2
step 70b_tp2 60 "${gen[@]}" --model llama2-70b --tp 2
step 70b_tp2_macko 90 "${gen[@]}" --model llama2-70b --tp 2 --sparse macko --density 0.5

python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
from minfer.config import KNOWN_CONFIGS, ModelConfig
import torch

out = Path(sys.argv[1])
def last_json(name):
    try:
        lines = [l for l in (out / f"{name}.txt").read_text().splitlines() if l.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except OSError:
        return None
try:
    copy = float((out / "copy_rate.txt").read_text().split()[-1])
except (OSError, ValueError, IndexError):
    copy = None
print(f"copy rate {copy} GB/s (read + write)")
base = last_json("7b_tp1")
for name in ("7b_tp1", "7b_tp2", "7b_tp2_nccl", "70b_tp2", "70b_tp2_macko"):
    run = last_json(name)
    if run is None:
        print(f"{name:14} no result (see {name}.txt)")
        continue
    s, tp = run["stats"], run["tensor_parallel"]
    config = ModelConfig.from_hf(KNOWN_CONFIGS["llama2-" + name.split("_")[0]])
    weights = config.weight_bytes(torch.float16)
    floor = weights / (tp * copy * 1e9) if copy else None  # seconds per token at the copy rate, all GPUs busy
    line = (f"{name:14} TP {tp}  {s['decode_tok_s']:7.1f} tok/s  peak {s['peak_mem_gb']:6.2f} GB/GPU  "
            f"weights {s['weight_gb_s']:6.0f} GB/s/GPU")
    if floor and run["sparse"] == "dense":
        line += f"  {100 * s['decode_tok_s'] * floor:5.1f}% of the floor"
    if base and name.startswith("7b") and name != "7b_tp1":
        line += f"  {s['decode_tok_s'] / base['stats']['decode_tok_s']:.2f}x TP 1"
    print(line)
EOF
printf '%s\n' "---- steps" "${summary[@]}"
tail -n 3 "$OUT/allreduce_tests.txt" "$OUT/gpu_tp_tests.txt" 2>/dev/null
