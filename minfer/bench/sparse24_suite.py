"""The 2:4 study on Llama-2-7B shapes pruned to 2:4 by magnitude: minfer's 2:4 path against cuBLAS dense,
minfer's dense kernels and torch's 2:4 (cuSPARSELt, sparse weight first: torch.mm(W_sparse, x^T), its
native orientation), and llama2-7b decode with random weights: dense, MACKO at d = 0.5 and 2:4 (run first: torch's
cuSPARSELt slows a later 2:4 prefill in the same process).

    python -m minfer.bench.sparse24_suite --json out/sparse24.json                 # every section
    python -m minfer.bench.sparse24_suite --sections decode --tokens 1,2,8,16       # one section
    python apps/benchmark.py --suite sparse24

decode: 1..16 tokens, minfer's 2:4 GEMV (ops.sparse24_gemv) against minfer's dense GEMV (up to 8 tokens),
cuBLAS and cuSPARSELt. prefill: 512, 2048, 8192 tokens, what a 2:4 layer runs for them and the sparse
tensor-core GEMM (ops.sparse24_gemm, sm_90; its largest error against cuBLAS over its tiles beside it), against
cuBLAS, minfer's HGEMM and cuSPARSELt. Graph-capturable ops run
back to back in a CUDA graph over copies rotated past L2 (`timing.time_graph`); cuSPARSELt is timed eagerly,
back to back between two events.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch
import torch.nn.functional as F

from .. import ops
from ..cli import ArgumentParser
from ..formats import FORMATS, convert
from ..formats.macko import release_scratch
from ..sparsity import prune_model_
from . import e2e_suite, report
from .arg_types import csv_list, positive_int
from .cases_macko import LLAMA2_7B_SHAPES, rotated
from .cases_sparse24 import matrix_24, sparse24_bytes
from .macko_suite import bandwidth, print_study, run_study, time_eager
from .suites import Suite, SuiteRun, register
from .timing import copy_bandwidth_gbs, rotation_count, time_graph

SECTIONS = ("decode", "prefill", "e2e")
DECODE_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16)
PREFILL_TOKENS = (512, 2048, 8192)
GEMM_DECODE_TOKENS = 8  # decode rows from this many tokens also time the sparse GEMM
E2E_FORMATS = ("dense", "macko d=0.5", "2:4")

COLUMNS = {
    "decode": [report.Column(*c) for c in [
        ("shape", "shape"), ("tokens", "T"), ("minfer_ms", "2:4 ms", "{:.4f}"), ("pct_copy", "% copy", "{:.1f}"),
        ("gemv_ms", "minfer dense ms", "{:.4f}"), ("vs_gemv", "vs minfer dense", "{:.2f}x"),
        ("cublas_ms", "cuBLAS ms", "{:.4f}"), ("vs_cublas", "vs cuBLAS", "{:.2f}x"),
        ("cusparselt_ms", "cuSPARSELt ms", "{:.4f}"), ("vs_cusparselt", "vs cuSPARSELt", "{:.2f}x"),
        ("gemm_ms", "sparse GEMM ms", "{:.4f}"), ("gemm_vs_cublas", "GEMM vs cuBLAS", "{:.2f}x")]],
    "prefill": [report.Column(*c) for c in [
        ("shape", "shape"), ("tokens", "T"), ("minfer_ms", "2:4 layer ms", "{:.4f}"),
        ("cublas_ms", "cuBLAS ms", "{:.4f}"), ("vs_cublas", "vs cuBLAS", "{:.2f}x"),
        ("gemm_ms", "sparse GEMM ms", "{:.4f}"), ("gemm_vs_cublas", "GEMM vs cuBLAS", "{:.2f}x"),
        ("gemm_vs_cusparselt", "GEMM vs cuSPARSELt", "{:.2f}x"), ("gemm_error", "GEMM rel err", "{:.1e}"),
        ("hgemm_ms", "minfer hgemm ms", "{:.4f}"), ("cusparselt_ms", "cuSPARSELt ms", "{:.4f}"),
        ("vs_cusparselt", "vs cuSPARSELt", "{:.2f}x"), ("cusparselt_vs_cublas", "cuSPARSELt vs cuBLAS", "{:.2f}x")]],
    "e2e": [report.Column(*c) for c in [
        ("model", "model"), ("format", "weights"), ("weight_gb", "weights GB", "{:.2f}"),
        ("decode_tok_s", "decode tok/s", "{:.1f}"), ("vs_dense", "vs dense", "{:.2f}x"),
        ("weight_gb_s", "weights GB/s", "{:.0f}"), ("pct_copy", "% copy", "{:.1f}"),
        ("prefill_ms", "prefill ms", "{:.1f}"), ("vs_dense_prefill", "prefill vs dense", "{:.2f}x"),
        ("peak_mem_gb", "peak GB", "{:.2f}")]],
}


class Matrix:
    """One Llama matrix pruned to 2:4: dense, as minfer's 2:4 format, and as torch's cuSPARSELt tensor."""

    def __init__(self, n: int, k: int, dtype: torch.dtype):
        self.n, self.k, self.dtype, self.shape = n, k, dtype, f"{n}x{k}"
        self.dense = matrix_24(n, k, dtype)
        self.fmt = FORMATS["2:4"].from_dense(self.dense)

    def time_graph(self, op: Callable[[torch.Tensor, int], object], tokens: int, tensors: tuple[torch.Tensor, ...],
                   replays: int) -> float:
        copies = rotated(tensors, rotation_count(sum(t.numel() * t.element_size() for t in tensors)))
        x = torch.randn(tokens, self.k, device="cuda", dtype=self.dtype)
        return time_graph(lambda i: op(x, *copies[i]), len(copies), replays=replays)

    def time_cusparselt(self, tokens: int, replays: int) -> float | None:
        """torch.mm(W_sparse, x^T) through cuSPARSELt, or None where torch refuses the shape or the device."""
        from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured

        SparseSemiStructuredTensor._FORCE_CUTLASS = False
        try:
            copies = [to_sparse_semi_structured(self.dense.clone())
                      for _ in range(rotation_count(self.n * self.k * 2 * 9 // 16))]
            x_t = torch.randn(self.k, tokens, device="cuda", dtype=self.dtype)
            return time_eager(lambda i: torch.mm(copies[i], x_t), len(copies), replays)
        except (RuntimeError, ValueError) as exc:
            print(f"  cuSPARSELt {self.shape} T{tokens}: {str(exc).splitlines()[0][:120]}", flush=True)
            return None


def ratio(baseline: float | None, ms: float) -> float | None:
    return None if baseline is None else baseline / ms


def decode_row(m: Matrix, tokens: int, copy_gbs: float, replays: int) -> dict:
    ms = m.time_graph(ops.sparse24_gemv, tokens, (m.fmt.values, m.fmt.meta, m.fmt.gemv_metadata()), replays)
    gemv_ms = m.time_graph(ops.gemv, tokens, (m.dense,), replays) if tokens <= ops.GEMV_MAX_TOKENS else None
    cublas_ms = m.time_graph(F.linear, tokens, (m.dense,), replays)
    cusparselt_ms = m.time_cusparselt(tokens, replays)
    nbytes = sparse24_bytes(m.fmt.values, m.fmt.meta, m.n, m.k, tokens)
    row = {"shape": m.shape, "tokens": tokens, "minfer_ms": ms, "pct_copy": bandwidth(nbytes, ms, copy_gbs)[1],
           "gemv_ms": gemv_ms, "vs_gemv": ratio(gemv_ms, ms), "cublas_ms": cublas_ms, "vs_cublas": cublas_ms / ms,
           "cusparselt_ms": cusparselt_ms, "vs_cusparselt": ratio(cusparselt_ms, ms)}
    if tokens >= GEMM_DECODE_TOKENS and ops.sparse24_gemm_takes(m.dense, m.n, m.k):
        # where the GEMM (each weight read once, tiles zero-filled past the tokens) would beat the GEMV
        gemm_ms = time_layers(m, tokens, replays,
                              lambda layer, x: ops.sparse24_gemm(x, layer.values, layer.gemm_metadata()))
        row.update(gemm_ms=gemm_ms, gemm_vs_cublas=cublas_ms / gemm_ms)
    return row


def time_layers(m: Matrix, tokens: int, replays: int, op: Callable[[torch.nn.Module, torch.Tensor], object]) -> float:
    """`op(layer, x)` over 2:4 layers on copies of the arrays rotated past L2 (their GEMM metadata built first)."""
    gemm_bytes = m.fmt.gemm_metadata().numel() * 4
    copies = rotated((m.fmt.values, m.fmt.meta), rotation_count(m.fmt.nbytes + gemm_bytes))
    layers = [FORMATS["2:4"](values, meta, (m.n, m.k)) for values, meta in copies]
    for layer in layers:
        layer.gemm_metadata()
    x = torch.randn(tokens, m.k, device="cuda", dtype=m.dtype)
    return time_graph(lambda i: op(layers[i], x), len(layers), replays=replays)


def gemm_error(m: Matrix, tokens: int) -> float:
    """The largest relative error (Frobenius) of the sparse GEMM's tiles against cuBLAS on one input."""
    x = torch.randn(tokens, m.k, device="cuda", dtype=m.dtype)
    expected = F.linear(x, m.dense).float()
    return max(float((ops.sparse24_gemm(x, m.fmt.values, m.fmt.gemm_metadata(), tile=tile).float() - expected).norm()
                     / expected.norm()) for tile in ops.SPARSE24_GEMM_TILES)


def prefill_row(m: Matrix, tokens: int, replays: int) -> dict:
    ms = time_layers(m, tokens, replays, lambda layer, x: layer(x))
    cublas_ms = m.time_graph(F.linear, tokens, (m.dense,), replays)
    cusparselt_ms = m.time_cusparselt(tokens, replays)
    row = {"shape": m.shape, "tokens": tokens, "minfer_ms": ms, "cublas_ms": cublas_ms, "vs_cublas": cublas_ms / ms,
           "hgemm_ms": m.time_graph(ops.hgemm, tokens, (m.dense,), replays), "cusparselt_ms": cusparselt_ms,
           "vs_cusparselt": ratio(cusparselt_ms, ms),
           "cusparselt_vs_cublas": ratio(cublas_ms, cusparselt_ms) if cusparselt_ms else None}
    if ops.sparse24_gemm_takes(m.dense, m.n, m.k):
        gemm_ms = time_layers(m, tokens, replays,
                              lambda layer, x: ops.sparse24_gemm(x, layer.values, layer.gemm_metadata()))
        row.update(gemm_ms=gemm_ms, gemm_vs_cublas=cublas_ms / gemm_ms,
                   gemm_vs_cusparselt=ratio(cusparselt_ms, gemm_ms), gemm_error=gemm_error(m, tokens))
    return row


def run(sections=SECTIONS, shapes=LLAMA2_7B_SHAPES, decode_tokens=DECODE_TOKENS, prefill_tokens=PREFILL_TOKENS,
        dtype=torch.float16, replays=20, on_row: Callable[[str, dict], None] = lambda section, row: None,
        copy_gbs: float | None = None) -> tuple[float, dict[str, list[dict]]]:
    """The kernel sections (decode, prefill) over `shapes`."""
    copy_gbs = copy_gbs or copy_bandwidth_gbs()
    results: dict[str, list[dict]] = {s: [] for s in sections if s != "e2e"}

    def emit(section, row):
        results[section].append(row)
        on_row(section, row)

    for n, k in shapes:
        if not results:
            break
        m = Matrix(n, k, dtype)
        if "decode" in results:
            for tokens in decode_tokens:
                emit("decode", decode_row(m, tokens, copy_gbs, replays))
        if "prefill" in results:
            for tokens in prefill_tokens:
                emit("prefill", prefill_row(m, tokens, replays))
        del m
        release_scratch()
        torch.cuda.empty_cache()
    return copy_gbs, results


def e2e_rows(model_name: str, prompt_tokens: int, new_tokens: int, dtype: torch.dtype, copy_gbs: float,
             on_row: Callable[[str, dict], None], embedding: str = "host") -> list[dict]:
    """Batch-1 decode and prefill of a random-weight model, dense, pruned by magnitude to d = 0.5 as MACKO,
    and pruned by magnitude to 2:4 as 2:4, in one process (the same prompt, EOS off)."""
    def prepare(fmt: str) -> Callable:
        def prune_and_convert(model) -> None:
            if fmt == "macko d=0.5":
                prune_model_(model, 0.5, "magnitude", progress=False)
                convert(model, "macko")
            elif fmt == "2:4":
                prune_model_(model, None, "magnitude", progress=False, structure=FORMATS["2:4"].structure)
                convert(model, "2:4")
        return prune_and_convert

    rows = []
    for fmt in E2E_FORMATS:
        stats = e2e_suite.measure_format(model_name, dtype, prepare(fmt), prompt_tokens, new_tokens, embedding)
        row = {"model": model_name, "format": fmt, **stats, "pct_copy": 100 * stats["weight_gb_s"] / copy_gbs}
        rows.append(row)
        on_row("e2e", {**row, "shape": model_name, "tokens": new_tokens, "minfer_ms": 1e3 / stats["decode_tok_s"]})
    dense = rows[0]
    for row in rows:
        row["vs_dense"] = row["decode_tok_s"] / dense["decode_tok_s"]
        row["vs_dense_prefill"] = dense["prefill_ms"] / row["prefill_ms"]
    return rows


def token_list(text: str) -> tuple[int, ...]:
    try:
        tokens = tuple(int(t) for t in csv_list(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not tokens or min(tokens) < 1:
        raise argparse.ArgumentTypeError(f"token counts are whole numbers >= 1, got {text!r}")
    return tokens


def run_step(bench: SuiteRun) -> dict:
    args = bench.args

    def on_row(section, row):
        print(f"  sparse24 {section} {row['shape']} T{row['tokens']}: {row['minfer_ms']:.4f} ms", flush=True)

    # end to end first: after torch's cuSPARSELt has run in a process, a 2:4 prefill there runs ~1.45x slower
    # (docs/perf-notes.md, 2026-11-28), and a user's generation never runs it
    copy_gbs = copy_bandwidth_gbs()
    bench.env["copy_gbs"] = round(copy_gbs, 1)
    e2e = e2e_rows(args.model, args.prompt_tokens, args.new_tokens, bench.dtype, copy_gbs, on_row, args.embedding)
    bench.save({"sparse24": {"e2e": e2e}})
    _, rows = run(("decode", "prefill"), dtype=bench.dtype, replays=args.reps, on_row=on_row, copy_gbs=copy_gbs)
    return {"sparse24": {**rows, "e2e": e2e}}


def report_step(bench: SuiteRun) -> None:
    for section, rows in bench.results["sparse24"].items():
        report.print_table(f"2:4 {section} ({bench.env.get('device')}, {bench.args.dtype})", COLUMNS[section], rows)


register(Suite("sparse24", {"sparse24": dict}, run_step, report_step,
               help="the 2:4 study: GEMV and prefill against cuBLAS, minfer dense and cuSPARSELt, then decode beside "
                    "dense and MACKO d=0.5 (also `python -m minfer.bench.sparse24_suite`)",
               flags=("reps", "model", "prompt_tokens", "new_tokens", "embedding"), e2e=True))


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m minfer.bench.sparse24_suite", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    parser.add_argument("--tokens", type=token_list, default=None,
                        help=f"decode: token counts, 1..{ops.SPARSE24_GEMV_MAX_TOKENS} (default "
                             f"{','.join(map(str, DECODE_TOKENS))})")
    parser.add_argument("--prefill-tokens", type=token_list, default=PREFILL_TOKENS,
                        help=f"prefill: token counts (default {','.join(map(str, PREFILL_TOKENS))})")
    parser.add_argument("--reps", type=positive_int, default=20, help="timed replays per measurement (median)")
    parser.add_argument("--model", default="llama2-7b", help="e2e: known model alias, random weights")
    parser.add_argument("--prompt-tokens", type=positive_int, default=512, help="e2e prompt length (default 512)")
    parser.add_argument("--new-tokens", type=positive_int, default=256, help="e2e decoded tokens (default 256)")
    parser.add_argument("--json", metavar="PATH", help="write the environment and every row as JSON")
    args = parser.parse_args(argv)
    if args.tokens and max(args.tokens) > ops.SPARSE24_GEMV_MAX_TOKENS:
        parser.error(f"--tokens: the 2:4 GEMV takes 1..{ops.SPARSE24_GEMV_MAX_TOKENS} tokens")
    return run_study(parser, args, set(SECTIONS), "the 2:4 study", study)


def study(args: argparse.Namespace, sections: list[str]) -> int:
    env = report.environment()
    report.print_environment(env)
    done: dict[str, list[dict]] = {s: [] for s in sections}

    def on_row(section: str, row: dict) -> None:
        print(f"  {section} {row['shape']} T{row['tokens']}: {row['minfer_ms']:.4f} ms", flush=True)
        done[section].append(row)
        if args.json:  # rewritten after every row, so a run cut short keeps what it measured
            report.write_json(args.json, env, done)

    copy_gbs = copy_bandwidth_gbs()
    e2e = e2e_rows(args.model, args.prompt_tokens, args.new_tokens, torch.float16, copy_gbs, on_row) \
        if "e2e" in sections else None  # first, as in run_step
    _, results = run(sections, decode_tokens=args.tokens or DECODE_TOKENS, prefill_tokens=args.prefill_tokens,
                     replays=args.reps, on_row=on_row, copy_gbs=copy_gbs)
    if e2e is not None:
        results["e2e"] = e2e
    return print_study("2:4", env, copy_gbs, results, COLUMNS, args.json)


if __name__ == "__main__":
    sys.exit(main())
