"""Prefill HGEMM against cuBLAS (torch.mm, the kernel F.linear runs) at the Llama projection shapes.

    python -m minfer.bench.hgemm_suite [--kernels auto,sm80] [--tokens 512,2048] [--json PATH]

Each case is timed back to back in a CUDA graph over rotated input copies (minfer.bench.timing),
cuBLAS in the same run, and each kernel's output is checked against cuBLAS's.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch

from minfer import ops
from minfer.cli import ArgumentParser
from minfer.bench.report import environment
from minfer.bench.timing import rotation_count, time_graph

# (N, K) of the Llama-2-7B projections, q/k/v and gate/up fused as the model holds them.
LLAMA_SHAPES = {
    "qkv": (12288, 4096),
    "o": (4096, 4096),
    "gate_up": (22016, 4096),
    "down": (4096, 11008),
    "lm_head": (32000, 4096),
}
TOKENS = (16, 128, 512, 2048, 8192, 16384)


@dataclass(frozen=True)
class HgemmCase:
    name: str
    m: int
    n: int
    k: int

    @property
    def flop(self) -> int:
        return 2 * self.m * self.n * self.k


def hgemm_cases(tokens=TOKENS, shapes=LLAMA_SHAPES) -> list[HgemmCase]:
    return [HgemmCase(f"{name} M={m}", m, n, k) for name, (n, k) in shapes.items() for m in tokens]


def measure(case: HgemmCase, dtype: torch.dtype, kernels=("auto",), replays: int = 20) -> dict:
    """Median ms and TFLOP/s of cuBLAS and of each named kernel on one case, in one run."""
    m, n, k = case.m, case.n, case.k
    copies = rotation_count(2 * (m * k + n * k + m * n))
    xs = [torch.randn(m, k, device="cuda", dtype=dtype) for _ in range(copies)]
    ws = [(torch.randn(n, k, device="cuda") / k**0.5).to(dtype) for _ in range(copies)]
    ys = [torch.empty(m, n, device="cuda", dtype=dtype) for _ in range(copies)]

    def cublas(i):
        torch.mm(xs[i], ws[i].t(), out=ys[i])

    result = {"case": case.name, "m": m, "n": n, "k": k, "dtype": str(dtype).removeprefix("torch.")}
    ms = time_graph(cublas, copies, replays=replays)
    result["cublas"] = {"ms": ms, "tflops": case.flop / ms / 1e9}
    expected = ys[0].float()
    for kernel in kernels:
        ys[0].fill_(float("nan"))
        ms = time_graph(lambda i: ops.hgemm_tuned(xs[i], ws[i], out=ys[i], kernel=kernel), copies, replays=replays)
        error = ((ys[0].float() - expected).norm() / expected.norm()).item()
        result[kernel] = {
            "ms": ms,
            "tflops": case.flop / ms / 1e9,
            "vs_cublas": result["cublas"]["ms"] / ms,
            "rel_error_vs_cublas": error,
        }
    for copies_of_one_operand in (xs, ws, ys):  # the closures above keep the lists, not the tensors
        copies_of_one_operand.clear()
    torch.cuda.empty_cache()
    return result


def format_table(results: list[dict], kernels) -> str:
    head = f"{'case':<20} {'M':>6} {'N':>6} {'K':>6} {'cuBLAS TF/s':>12}"
    for kernel in kernels:
        head += f" {kernel + ' TF/s':>18} {'%':>6}"
    lines = [head]
    for r in results:
        line = f"{r['case']:<20} {r['m']:>6} {r['n']:>6} {r['k']:>6} {r['cublas']['tflops']:>12.1f}"
        for kernel in kernels:
            line += f" {r[kernel]['tflops']:>18.1f} {100 * r[kernel]['vs_cublas']:>5.1f}%"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m minfer.bench.hgemm_suite", description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="auto", help=f"comma-separated, from {', '.join(ops.HGEMM_KERNELS)}")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated M values")
    parser.add_argument("--shapes", default=",".join(LLAMA_SHAPES), help="comma-separated, from the Llama shapes")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    ops.require_cuda("the HGEMM benchmark")
    ops.build()
    kernels = args.kernels.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    shapes = {name: LLAMA_SHAPES[name] for name in args.shapes.split(",")}
    dtype = getattr(torch, args.dtype)
    results = []
    for case in hgemm_cases(tokens, shapes):
        results.append(measure(case, dtype, kernels, args.replays))
        print(format_table(results[-1:], kernels).splitlines()[-1], flush=True)
    print(format_table(results, kernels))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "kernels": kernels, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
