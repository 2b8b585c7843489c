"""The GEMV launch-configuration sweep: every (warps per block, unroll) pair of the register-streaming
kernel and every stages-per-block choice of the bulk-copy kernel (sm_90) on the decode shapes, against
F.linear and the device copy rate, to pick the defaults for a new GPU (kernels/gemv.cu).

    python -m minfer.bench.gemv_sweep --json out/gemv-sweep.json
    python -m minfer.bench.gemv_sweep --shapes 4096x4096 --tokens 1,8 --norm

Each configuration runs back to back in a CUDA graph over weight copies rotated past L2.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from .. import ops
from . import report
from .cases_gemv import DECODE_SHAPES
from .timing import copy_bandwidth_gbs, rotation_count, time_graph

REGISTER_CONFIGS = [dict(warps_per_block=w, unroll=u) for w in (4, 8, 16) for u in (2, 4, 8) if (w, u) != (16, 8)]
BULK_CONFIGS = [dict(stages_per_block=s) for s in (1, 2, 3, 4, 6, 8)]
COLUMNS = [report.Column(*c) for c in [
    ("shape", "shape"), ("tokens", "T"), ("config", "config"), ("ms", "ms", "{:.4f}"),
    ("pct_copy", "% copy", "{:.1f}"), ("vs_cublas", "vs cuBLAS", "{:.2f}x"), ("best", "")]]


def config_name(config: dict) -> str:
    if not config:
        return "default"
    if "stages_per_block" in config:
        return f"bulk {config['stages_per_block']} stages"
    return f"regs {config['warps_per_block']}/{config['unroll']}"


def sweep_shape(n: int, k: int, tokens: int, dtype: torch.dtype, copy_gbs: float, replays: int,
                norm: bool) -> list[dict]:
    """With `norm`, every configuration runs with the RMSNorm fused (as qkv, gate_up and lm_head do)."""
    nbytes = torch.finfo(dtype).bits // 8 * (n * k + tokens * (n + k))
    weights = [(torch.randn(n, k, device="cuda") / k**0.5).to(dtype) for _ in range(rotation_count(nbytes))]
    x = torch.randn(tokens, k, device="cuda", dtype=dtype)
    out = torch.empty(tokens, n, device="cuda", dtype=dtype)
    cublas_ms = time_graph(lambda i: F.linear(x, weights[i]), len(weights), replays=replays)
    g = torch.ones(k, device="cuda", dtype=dtype) if norm else None
    bulk = torch.cuda.get_device_capability() >= (9, 0)
    rows = []
    for config in [{}, *REGISTER_CONFIGS, *(BULK_CONFIGS if bulk else [])]:
        ms = time_graph(lambda i: ops.gemv(x, weights[i], out=out, norm_weight=g, eps=1e-5, **config),
                        len(weights), replays=replays)
        rows.append({"shape": f"{n}x{k}", "tokens": tokens, "norm": norm, **config,
                     "config": config_name(config), "ms": ms,
                     "pct_copy": 100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbs, "vs_cublas": cublas_ms / ms,
                     "cublas_ms": cublas_ms})
    fastest = min(rows[1:], key=lambda r: r["ms"])
    fastest["best"] = "fastest"
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minfer.bench.gemv_sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=None, help="comma list of NxK (default: the Llama decode shapes)")
    parser.add_argument("--tokens", default="1", help="comma list of token counts, 1..8 (default: 1)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--norm", action="store_true", help="fuse the RMSNorm (as the qkv, gate_up and lm_head projections do)")
    parser.add_argument("--reps", type=int, default=20, help="timed replays per measurement (median)")
    parser.add_argument("--json", metavar="PATH", help="write the environment and every row as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the GEMV sweep needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else DECODE_SHAPES
    token_counts = [int(t) for t in args.tokens.split(",")]
    if not all(1 <= t <= ops.GEMV_MAX_TOKENS for t in token_counts):
        parser.error(f"--tokens must lie in 1..{ops.GEMV_MAX_TOKENS}")
    env = report.environment()
    report.print_environment(env)
    copy_gbs = copy_bandwidth_gbs()
    env["copy_gbs"] = round(copy_gbs, 1)
    rows = []
    for tokens in token_counts:
        for n, k in shapes:
            rows += sweep_shape(n, k, tokens, getattr(torch, args.dtype), copy_gbs, args.reps, args.norm)
            print(f"  {n}x{k} t{tokens}: done", flush=True)
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    report.print_table(f"GEMV launch configurations ({env.get('device')})", COLUMNS, rows)
    if args.json:
        report.write_json(args.json, env, {"gemv_sweep": rows})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
