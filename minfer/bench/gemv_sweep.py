"""The GEMV launch-configuration sweep: every (warps per block, unroll) pair of the tensor-core GEMV on
the decode shapes, against F.linear and the device copy rate, to pick the defaults for a new GPU
(`default_tuning` in kernels/dense/gemv.cu).

    python -m minfer.bench.gemv_sweep --json out/gemv-sweep.json
    python -m minfer.bench.gemv_sweep --shapes 4096x4096 --tokens 1,8

Each configuration runs back to back in a CUDA graph over weight copies rotated past L2.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from .. import ops
from ..cli import ArgumentParser
from . import report
from ..errors import MinferError
from .arg_types import matrix_shape_list, positive_int, token_count_list
from .cases_gemv import DECODE_SHAPES
from .timing import copy_bandwidth_gbs, rotation_count, time_graph

CONFIGS = [(w, u) for w in (4, 8, 16) for u in (2, 4, 8) if (w, u) != (16, 8)]  # (warps per block, unroll)
COLUMNS = [report.Column(*c) for c in [
    ("shape", "shape"), ("tokens", "T"), ("config", "warps/unroll"), ("ms", "ms", "{:.4f}"),
    ("pct_copy", "% copy", "{:.1f}"), ("vs_cublas", "vs cuBLAS", "{:.2f}x"), ("best", "")]]


def sweep_shape(n: int, k: int, tokens: int, dtype: torch.dtype, copy_gbs: float, replays: int) -> list[dict]:
    nbytes = torch.finfo(dtype).bits // 8 * (n * k + tokens * (n + k))
    weights = [(torch.randn(n, k, device="cuda") / k**0.5).to(dtype) for _ in range(rotation_count(nbytes))]
    x = torch.randn(tokens, k, device="cuda", dtype=dtype)
    out = torch.empty(tokens, n, device="cuda", dtype=dtype)
    cublas_ms = time_graph(lambda i: F.linear(x, weights[i]), len(weights), replays=replays)
    rows = []
    for warps, unroll in [(0, 0), *CONFIGS]:
        ms = time_graph(lambda i: ops.gemv_tuned(x, weights[i], out=out, warps_per_block=warps, unroll=unroll),
                        len(weights), replays=replays)
        rows.append({"shape": f"{n}x{k}", "tokens": tokens, "warps_per_block": warps, "unroll": unroll,
                     "config": "default" if warps == 0 else f"{warps}/{unroll}", "ms": ms,
                     "pct_copy": 100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbs, "vs_cublas": cublas_ms / ms,
                     "cublas_ms": cublas_ms})
    fastest = min(rows[1:], key=lambda r: r["ms"])
    fastest["best"] = "fastest"
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m minfer.bench.gemv_sweep", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=matrix_shape_list, default=None,
                        help="comma list of NxK (default: the Llama decode shapes)")
    parser.add_argument("--tokens", type=token_count_list, default=[1],
                        help=f"comma list of token counts, 1..{ops.GEMV_MAX_TOKENS} (default: 1)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--reps", type=positive_int, default=20, help="timed replays per measurement (median)")
    parser.add_argument("--json", metavar="PATH", help="write the environment and every row as JSON")
    args = parser.parse_args(argv)
    shapes = args.shapes or DECODE_SHAPES
    token_counts = args.tokens
    if not all(t <= ops.GEMV_MAX_TOKENS for t in token_counts):
        parser.error(f"--tokens must lie in 1..{ops.GEMV_MAX_TOKENS}")
    if not torch.cuda.is_available():
        print("error: the GEMV sweep needs a CUDA GPU", file=sys.stderr)
        return 2
    ops.build()
    env = report.environment()
    report.print_environment(env)
    copy_gbs = copy_bandwidth_gbs()
    env["copy_gbs"] = round(copy_gbs, 1)
    rows = []
    for tokens in token_counts:
        for n, k in shapes:
            rows += sweep_shape(n, k, tokens, getattr(torch, args.dtype), copy_gbs, args.reps)
            print(f"  {n}x{k} t{tokens}: done", flush=True)
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    report.print_table(f"GEMV launch configurations ({env.get('device')})", COLUMNS, rows)
    if args.json:
        try:
            report.write_json(args.json, env, {"gemv_sweep": rows})
        except MinferError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
