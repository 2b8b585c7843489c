"""The KS factor kernel study (apps/benchmark.py --suite ksmm): one factor per case, minfer's fused kernel
against the three torch formulations, and the end-to-end rows of a Llama with every projection a KS chain.

Grid: patterns (a, b, c, d) with b, c from 64 to 2048 and a·d from 1 to 64 (split as a alone, d alone and
both), plus the factors of the monarch-50 chains of Llama-2-7B's projections, at B = 1, 16, 512 and 4096
tokens. A case whose x, y or factor would pass MAX_CASE_BYTES is left out. Baselines, each timed the same way
(CUDA graph, inputs and factors rotated past L2, median of replays):
- dense: the factor's matrix stored dense, times x with torch.mm (cuBLAS), while it fits MAX_DENSE_BYTES;
- einsum: torch.einsum("nikl,ijkl->nijl") on the views (torch picks its own permutations);
- bmm: x permuted to (a·d, B, c), one bmm against the factor stored pre-permuted as (a·d, c, b), y permuted
  back: the seed's bmm algorithm with both permutation copies timed.
minfer is a one-factor KS weight's forward (on the wgmma kernel a d > 1 factor reads its per-l W copy, built
at the warm-up, and gathers x into its batch-major order first). Below KSMM_WGMMA_MIN_TOKENS the same forward
is also timed with the wgmma kernel allowed (ops.ksmm_wgmma_from), where its plan takes the factor, and at 2-16
tokens the rows kernel: the evidence for the routing. A case is a win when minfer is at least
WIN_SPEEDUP times faster than the best baseline. At B = 1 the kernel's GB/s (factor, x and y bytes) is given
against the copy rate.
End to end: the random-weight model dense and with monarch-50 chains on all 7 projections, on minfer's kernels:
decode tokens/s at batch 1, weight bytes a decode step reads, and the prompt's prefill time (on sm_90 the chains'
prefill runs the wgmma kernel); on sm_90 once more with the prefill on the ring tiles (ops.ksmm_wgmma_from(None)).
wgmma (sm_90): the factors of Llama-2-7B's monarch-50 chains at WGMMA_BATCHES tokens on the wgmma kernel, each
tile width, a d = 1 factor also into its chain's next factor's batch-major order (a d > 1
factor reads its input in that order), against the mma.sync ring tiles and the best torch baseline; the per-l
copy of a d > 1 factor's W; and the ring tiles against wgmma at small batches, for the threshold.
"""

from __future__ import annotations

import gc
import statistics
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch

from .. import ops
from ..errors import MinferError
from ..formats.ksmm import KSWeight, Pattern
from ..sparsity.factorize import monarch_chain, random_chains
from . import e2e_suite, report
from .suites import Suite, SuiteRun, register
from .timing import copy_bandwidth_gbs, rotation_count, time_graph

BATCHES = (1, 16, 512, 4096)
BLOCK_SIZES = ((64, 64), (256, 256), (1024, 1024), (2048, 2048), (256, 1024), (2048, 512))  # (b, c)
BLOCK_COUNTS = ((1, 1), (4, 1), (1, 4), (2, 2), (16, 1), (1, 16), (4, 4), (64, 1), (1, 64), (8, 8))  # (a, d)
LLAMA2_7B_PROJECTIONS = ((4096, 4096), (11008, 4096), (4096, 11008))  # (N, K): q/k/v/o, gate/up, down
MAX_CASE_BYTES = 256 << 20
MAX_DENSE_BYTES = 512 << 20
WIN_SPEEDUP = 1.2
LARGE_FACTOR_BYTES = 8 << 20  # the B = 1 bandwidth bar applies from this factor size on
BASELINES = ("dense", "einsum", "bmm")
KS_PRESET = "monarch-50"
WGMMA_BATCHES = (512, 4096)
WGMMA_THRESHOLD_BATCHES = (17, 32, 64, 128, 256)

COLUMNS = {
    "grid": [report.Column(*c) for c in [
        ("pattern", "pattern (a,b,c,d)"), ("tokens", "B"), ("factor_mb", "factor MB", "{:.1f}"),
        ("path", "kernel"), ("minfer_ms", "minfer ms", "{:.4f}"), ("rows_ms", "rows ms", "{:.4f}"),
        ("wgmma_ms", "wgmma ms", "{:.4f}"), ("dense_ms", "dense ms", "{:.4f}"),
        ("einsum_ms", "einsum ms", "{:.4f}"), ("bmm_ms", "bmm ms", "{:.4f}"), ("best", "best torch"),
        ("speedup", "vs best", "{:.2f}x"), ("tflops", "TFLOP/s", "{:.1f}"), ("pct_copy", "% copy", "{:.1f}")]],
    "summary": [report.Column(*c) for c in [
        ("tokens", "B"), ("cases", "cases"), ("wins", f"wins (>= {WIN_SPEEDUP}x)"), ("win_rate", "win rate", "{:.0%}"),
        ("median_speedup", "median vs best", "{:.2f}x"), ("min_speedup", "min", "{:.2f}x"),
        ("pct_copy_large", "B=1 % copy, factors >= 8 MB (min / median)")]],
    "e2e": [report.Column(*c) for c in [
        ("model", "model"), ("format", "projections"), ("weight_gb", "decode weights GB", "{:.2f}"),
        ("decode_tok_s", "decode tok/s", "{:.1f}"), ("vs_dense_decode", "vs dense", "{:.2f}x"),
        ("prefill_ms", "prefill ms", "{:.1f}"), ("vs_dense_prefill", "prefill vs dense", "{:.2f}x"),
        ("peak_mem_gb", "peak GB", "{:.2f}")]],
    "wgmma": [report.Column(*c) for c in [
        ("pattern", "pattern (a,b,c,d)"), ("tokens", "B"), ("wgmma_us", "wgmma us", "{:.1f}"),
        ("tflops", "TFLOP/s", "{:.0f}"), ("tiles", "us by tile 64/128/192/256"),
        ("chain_us", "into next's order us", "{:.1f}"), ("ring_us", "ring tiles us", "{:.1f}"),
        ("best_us", "best torch us", "{:.1f}"), ("best", "best torch"), ("speedup", "vs best", "{:.2f}x"),
        ("copy_us", "per-l W copy us", "{:.1f}"), ("max_err", "max rel err", "{:.1e}")]],
}


def grid_patterns() -> list[Pattern]:
    patterns = [(a, b, c, d) for b, c in BLOCK_SIZES for a, d in BLOCK_COUNTS]
    for shape in LLAMA2_7B_PROJECTIONS:
        patterns += [p for p in monarch_chain(shape, 0.5) if p not in patterns]
    return patterns


def case_fits(pattern: Pattern, tokens: int, size: int) -> bool:
    a, b, c, d = pattern
    return max(a * b * c * d, tokens * a * c * d, tokens * a * b * d) * size <= MAX_CASE_BYTES


def bmm_operands(factor: torch.Tensor) -> torch.Tensor:
    """The factor stored as the bmm baseline wants it, (a·d, c, b): W[i, :, :, l]^T per (i, l)."""
    a, b, c, d = factor.shape
    return factor.permute(0, 3, 2, 1).reshape(a * d, c, b).contiguous()


def bmm_product(x: torch.Tensor, operands: torch.Tensor, pattern: Pattern) -> torch.Tensor:
    a, b, c, d = pattern
    tokens = x.shape[0]
    gathered = x.view(tokens, a, c, d).permute(1, 3, 0, 2).reshape(a * d, tokens, c)
    return torch.bmm(gathered, operands).view(a, d, tokens, b).permute(2, 0, 3, 1).reshape(tokens, a * b * d)


def dense_matrix(factor: torch.Tensor) -> torch.Tensor:
    """The factor's (a·b·d) x (a·c·d) matrix, K[i·b·d + j·d + l, i·c·d + k·d + l] = W[i, j, k, l]."""
    a, b, c, d = factor.shape
    dense = factor.new_zeros(a, b, d, a, c, d)
    for i in range(a):
        for l in range(d):
            dense[i, :, l, i, :, l] = factor[i, :, :, l]
    return dense.view(a * b * d, a * c * d)


def time_case(pattern: Pattern, tokens: int, dtype: torch.dtype, reps: int, copy_gbs: float) -> dict:
    a, b, c, d = pattern
    size = torch.finfo(dtype).bits // 8
    factor_bytes, x_bytes, y_bytes = a * b * c * d * size, tokens * a * c * d * size, tokens * a * b * d * size
    copies = rotation_count(factor_bytes + x_bytes)
    factors = [(torch.randn(pattern, device="cuda") / c**0.5).to(dtype) for _ in range(copies)]
    xs = [torch.randn(tokens, a * c * d, device="cuda").to(dtype) for _ in range(copies)]
    out = torch.empty(tokens, a * b * d, device="cuda", dtype=dtype)
    layers = [KSWeight.from_factors([factor]) for factor in factors]  # what a KS projection runs
    plan = layers[0].wgmma_plan(xs[0])[0]
    path = ops.ksmm_path(pattern, tokens) if plan is None else "wgmma, x gathered" if plan[3] else "wgmma"
    row = {"pattern": str(pattern), "tokens": tokens, "factor_mb": factor_bytes / 2**20, "path": path}
    row["minfer_ms"] = time_graph(lambda i: layers[i](xs[i]), copies, reps)
    # the CUDA-core rows kernel where gemv is the auto choice (2..16 tokens): the evidence for that choice
    row["rows_ms"] = (time_graph(lambda i: ops.ksmm_tuned(xs[i], factors[i], out, path="rows"), copies, reps)
                      if row["path"] == "gemv" and ops.ksmm_kernel_takes("rows", pattern, tokens) else None)
    # the format's forward with the wgmma kernel allowed from this batch on, below KSMM_WGMMA_MIN_TOKENS: the
    # evidence for that threshold
    row["wgmma_ms"] = None
    if tokens > 1 and not ops.ksmm_wgmma_batch(tokens) and wgmma_runs():
        with ops.ksmm_wgmma_from(tokens):
            if layers[0].wgmma_plan(xs[0])[0] is not None:
                row["wgmma_ms"] = time_graph(lambda i: layers[i](xs[i]), copies, reps)
    dense_bytes = (a * b * d) * (a * c * d) * size
    if dense_bytes <= MAX_DENSE_BYTES:
        dense_copies = rotation_count(dense_bytes + x_bytes)
        dense = [dense_matrix(factors[i % copies]) for i in range(dense_copies)]
        row["dense_ms"] = time_graph(lambda i: torch.mm(xs[i % copies], dense[i].t(), out=out), dense_copies, reps)
        del dense
    else:
        row["dense_ms"] = None
    row["einsum_ms"] = time_graph(lambda i: torch.einsum("nikl,ijkl->nijl", xs[i].view(tokens, a, c, d),
                                                         factors[i]).reshape(tokens, a * b * d), copies, reps)
    operands = [bmm_operands(f) for f in factors]
    row["bmm_ms"] = time_graph(lambda i: bmm_product(xs[i], operands[i], pattern), copies, reps)
    timed = {name: row[f"{name}_ms"] for name in BASELINES if row[f"{name}_ms"] is not None}
    row["best"] = min(timed, key=timed.get)
    row["speedup"] = timed[row["best"]] / row["minfer_ms"]
    row["tflops"] = 2 * tokens * a * b * c * d / (row["minfer_ms"] * 1e-3) / 1e12
    row["gbs"] = (factor_bytes + x_bytes + y_bytes) / (row["minfer_ms"] * 1e-3) / 1e9
    row["pct_copy"] = 100 * row["gbs"] / copy_gbs if tokens == 1 else None
    return row


def wgmma_runs() -> bool:
    """Whether this GPU runs the wgmma kernel (an sm_90 part)."""
    return ops.ksmm_kernel_takes("wgmma", (1, 64, 64, 1), 512)


def wgmma_operands(pattern: Pattern, tokens: int, dtype: torch.dtype) -> tuple[int, list, list, list, list]:
    """Copies rotated past L2 of a factor, its groups (ops.ksmm_groups), x and x in the batch-major order."""
    a, b, c, d = pattern
    size = torch.finfo(dtype).bits // 8
    copies = rotation_count(size * (2 * a * b * c * d + 2 * tokens * a * c * d))
    factors = [(torch.randn(pattern, device="cuda") / c**0.5).to(dtype) for _ in range(copies)]
    xs = [torch.randn(tokens, a * c * d, device="cuda").to(dtype) for _ in range(copies)]
    return (copies, factors, [ops.ksmm_groups(f) for f in factors], xs,
            [ops.to_batch_major(x, c, d).contiguous() for x in xs])


def wgmma_case(pattern: Pattern, following: Pattern | None, tokens: int, dtype: torch.dtype, reps: int) -> dict:
    """One factor on the wgmma kernel (its input in the order the chain gives it), every variant timed and
    checked against float64; `following`: the chain's next factor when it has d > 1."""
    a, b, c, d = pattern
    copies, factors, groups, xs, xs_major = wgmma_operands(pattern, tokens, dtype)
    out = torch.empty(tokens, a * b * d, device="cuda", dtype=dtype)
    expected = ops.ksmm_reference(xs[0].double(), factors[0].double())
    errors = []

    def timed(next_c: int, next_d: int, **knobs) -> float:
        ops.ksmm_wgmma(xs_major[0], groups[0], d, next_c, next_d, out, **knobs)
        want = ops.to_batch_major(expected, next_c, next_d) if next_d > 1 else expected
        errors.append(float((out.double() - want).norm() / want.norm()))
        return time_graph(lambda i: ops.ksmm_wgmma(xs_major[i], groups[i], d, next_c, next_d, out, **knobs),
                          copies, reps)

    row = {"pattern": str(pattern), "tokens": tokens, "wgmma_us": 1e3 * timed(1, 1)}
    row["tflops"] = 2 * tokens * a * b * c * d / (row["wgmma_us"] * 1e-6) / 1e12
    row["tiles"] = " / ".join(f"{1e3 * timed(1, 1, tile_n=tile):.1f}" for tile in ops.KSMM_WGMMA_TILES if tile)
    if following is not None:
        _, _, next_c, next_d = following
        row["chain_us"] = 1e3 * timed(next_c, next_d)
    row["ring_us"] = 1e3 * time_graph(lambda i: ops.ksmm_tuned(xs[i], factors[i], out, path="tensor-core"),
                                      copies, reps)
    baseline = time_case(pattern, tokens, dtype, reps, copy_gbs=1.0)
    row["best"] = baseline["best"]
    row["best_us"] = 1e3 * baseline["speedup"] * baseline["minfer_ms"]
    row["speedup"] = row["best_us"] / row["wgmma_us"]
    if d > 1:
        scratch = torch.empty_like(groups[0])
        row["copy_us"] = 1e3 * time_graph(lambda i: scratch.view(a, d, b, c).copy_(factors[i].permute(0, 3, 1, 2)),
                                          copies, reps)
    row["max_err"] = max(errors)
    return row


def wgmma_rows(dtype: torch.dtype, reps: int, on_row: Callable[[dict], None]) -> list[dict]:
    """The monarch-50 factors of Llama-2-7B on the wgmma kernel, then the ring tiles against it at small
    batches (rows with `threshold`)."""
    rows = []
    for shape in LLAMA2_7B_PROJECTIONS:
        chain = monarch_chain(shape, 0.5)
        for index, pattern in enumerate(chain):
            following = chain[index + 1] if index + 1 < len(chain) and chain[index + 1][3] > 1 else None
            for tokens in WGMMA_BATCHES:
                rows.append(wgmma_case(pattern, following, tokens, dtype, reps))
                on_row(rows[-1])
                gc.collect()
                torch.cuda.empty_cache()
    for pattern in dict.fromkeys(p for shape in LLAMA2_7B_PROJECTIONS[:2] for p in monarch_chain(shape, 0.5)):
        a, b, c, d = pattern
        for tokens in WGMMA_THRESHOLD_BATCHES:
            copies, factors, groups, xs, xs_major = wgmma_operands(pattern, tokens, dtype)
            out = torch.empty(tokens, a * b * d, device="cuda", dtype=dtype)
            ring = time_graph(lambda i: ops.ksmm_tuned(xs[i], factors[i], out, path="tensor-core"), copies, reps)
            wgmma = time_graph(lambda i: ops.ksmm_wgmma(xs_major[i], groups[i], d, out=out), copies, reps)
            rows.append({"pattern": str(pattern), "tokens": tokens, "threshold": True, "ring_us": 1e3 * ring,
                         "wgmma_us": 1e3 * wgmma})
            on_row(rows[-1])
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    summary = []
    for tokens in (*dict.fromkeys(r["tokens"] for r in rows), None):
        chosen = [r for r in rows if tokens is None or r["tokens"] == tokens]
        if not chosen:
            continue
        speedups = [r["speedup"] for r in chosen]
        wins = sum(s >= WIN_SPEEDUP for s in speedups)
        large = [r["pct_copy"] for r in chosen
                 if r["pct_copy"] is not None and r["factor_mb"] * 2**20 >= LARGE_FACTOR_BYTES]
        summary.append({"tokens": "all" if tokens is None else tokens, "cases": len(chosen), "wins": wins,
                        "win_rate": wins / len(chosen), "median_speedup": statistics.median(speedups),
                        "min_speedup": min(speedups),
                        "pct_copy_large": f"{min(large):.1f} / {statistics.median(large):.1f}" if large else None})
    return summary


def run(dtype: torch.dtype, reps: int, on_row: Callable[[dict], None],
        batches: tuple[int, ...] = BATCHES) -> tuple[float, list[dict], list[dict]]:
    """(copy GB/s, one row per case, the summary per batch size and overall)."""
    copy_gbs = copy_bandwidth_gbs()
    size = torch.finfo(dtype).bits // 8
    rows = []
    for tokens in batches:
        for pattern in grid_patterns():
            if case_fits(pattern, tokens, size):
                rows.append(time_case(pattern, tokens, dtype, reps, copy_gbs))
                on_row(rows[-1])
                gc.collect()
                torch.cuda.empty_cache()
    return copy_gbs, rows, summarize(rows)


def e2e_rows(model_name: str, prompt_tokens: int, new_tokens: int, dtype: torch.dtype,
             on_row: Callable[[dict], None], embedding: str = "host") -> list[dict]:
    """Dense, then KS_PRESET chains on every projection (random factors), on minfer's kernels at batch 1."""
    def prepare(projections: str) -> Callable:
        def factorize(model) -> None:
            if projections != "dense":
                random_chains(model, projections)
        return factorize

    rows = []
    variants = [("dense", "dense", nullcontext()), (KS_PRESET, KS_PRESET, nullcontext())]
    if wgmma_runs():
        variants.append((KS_PRESET, f"{KS_PRESET}, ring-tile prefill", ops.ksmm_wgmma_from(None)))
    for projections, label, prefill_path in variants:
        with prefill_path:
            stats = e2e_suite.measure_format(model_name, dtype, prepare(projections), prompt_tokens, new_tokens,
                                             embedding)
        rows.append({"model": model_name, "format": label, **stats})
        on_row(rows[-1])
    dense = rows[0]
    for row in rows:
        row["vs_dense_decode"] = row["decode_tok_s"] / dense["decode_tok_s"]
        row["vs_dense_prefill"] = dense["prefill_ms"] / row["prefill_ms"]
    return rows


def plot(path: str, rows: list[dict], title: str) -> None:
    """Speedup over the best torch baseline per case, one column of points per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, bandwidth) = plt.subplots(1, 2, figsize=(11, 4))
    for position, tokens in enumerate(BATCHES):
        chosen = [r["speedup"] for r in rows if r["tokens"] == tokens]
        speed.scatter([position + (k % 9 - 4) * 0.04 for k in range(len(chosen))], chosen, s=10)
    speed.axhline(WIN_SPEEDUP, color="gray", linestyle="--", label=f"{WIN_SPEEDUP}x")
    speed.set(xticks=range(len(BATCHES)), xticklabels=[f"B={t}" for t in BATCHES], yscale="log",
              ylabel="speedup over the best torch baseline", title="KS factor kernel")
    speed.legend()
    single = [r for r in rows if r["tokens"] == 1]
    bandwidth.scatter([r["factor_mb"] for r in single], [r["pct_copy"] for r in single], s=10)
    bandwidth.axhline(70, color="gray", linestyle="--")
    bandwidth.set(xscale="log", xlabel="factor MB", ylabel="% of the copy rate", title="B = 1")
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_case(row: dict) -> None:
    print(f"  ksmm {row['pattern']} B={row['tokens']} {row['path']}: {row['minfer_ms'] * 1e3:.1f} us"
          + (f" (rows {row['rows_ms'] * 1e3:.1f} us)" if row["rows_ms"] is not None else "")
          + f", best torch {row['speedup'] * row['minfer_ms'] * 1e3:.1f} us ({row['best']}), {row['speedup']:.2f}x"
          + (f", {row['pct_copy']:.0f}% copy" if row["pct_copy"] is not None else ""), flush=True)


def run_step(bench: SuiteRun) -> dict:
    """The end-to-end rows first: they are the ones a cut-short run must keep."""
    args = bench.args
    rows: dict[str, list[dict]] = {}
    rows["e2e"] = e2e_rows(
        args.model, args.prompt_tokens, args.new_tokens, bench.dtype, embedding=args.embedding,
        on_row=lambda row: print(f"  ksmm e2e {row['format']}: {row['decode_tok_s']:.1f} tok/s, prefill "
                                 f"{row['prefill_ms']:.1f} ms", flush=True))
    bench.save({"ksmm": rows})
    if wgmma_runs():
        rows["wgmma"] = wgmma_rows(bench.dtype, args.reps, lambda row: print(f"  ksmm wgmma {row}", flush=True))
        bench.save({"ksmm": rows})
    copy_gbs, rows["grid"], rows["summary"] = run(bench.dtype, args.reps, print_case, grid_batches(args))
    bench.env["copy_gbs"] = round(copy_gbs, 1)
    return {"ksmm": rows}


def grid_batches(args) -> tuple[int, ...]:
    """--batches as integers (default BATCHES); MinferError on a value that is not a positive integer."""
    if args.batches is None:
        return BATCHES
    try:
        batches = tuple(int(value) for value in args.batches)
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        raise MinferError(f"--batches takes positive whole numbers, got {','.join(args.batches)}")
    return batches


def report_step(bench: SuiteRun) -> None:
    for section in ("grid", "wgmma", "summary", "e2e"):  # the summary and the end-to-end rows last
        rows = bench.results["ksmm"].get(section)
        if rows is None:
            continue
        if section == "wgmma":
            threshold = [r for r in rows if r.get("threshold")]
            rows = [r for r in rows if not r.get("threshold")]
            print("  ring tiles / wgmma us at small batches: " + ", ".join(
                f"{r['pattern']} B={r['tokens']} {r['ring_us']:.1f} / {r['wgmma_us']:.1f}" for r in threshold))
        report.print_table(f"KS factors: {section} ({bench.env.get('device')}, {bench.args.dtype})", COLUMNS[section],
                           rows)


def plot_step(bench: SuiteRun, path: str) -> bool:
    if not bench.results["ksmm"].get("grid"):
        return False
    plot(path, bench.results["ksmm"]["grid"], f"KS factors, {bench.env.get('device')}, {bench.args.dtype}")
    return True


register(Suite("ksmm", {"ksmm": dict}, run_step, report_step,
               flags=("plot", "reps", "model", "prompt_tokens", "new_tokens", "embedding", "batches"), e2e=True,
               check=grid_batches, plot=plot_step))
