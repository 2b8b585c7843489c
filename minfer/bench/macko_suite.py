"""The MACKO kernel study: SpMV against every baseline, the launch-configuration sweep, SpMM and
decompression, on Llama-2-7B shapes pruned per row to densities 0.1-0.9.

    python -m minfer.bench.macko_suite --json out/macko.json            # every kernel section
    python -m minfer.bench.macko_suite --sections spmv --densities 0.5  # one section, one density
    python -m minfer.bench.macko_suite --sections e2e --plot out/e2e.png  # llama2-7b decode per density

Graph-capturable ops run back to back in a CUDA graph over copies rotated past L2
(`timing.time_graph`); torch CSR and the dense reference (decompress, then F.linear) sync or
allocate, so they are timed eagerly, back to back between two events. GB/s counts the format's
own bytes (MACKO: values 2P + deltas P/2 + row_ptr; plus x and y) against the copy rate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .. import ops
from ..cli import ArgumentParser
from ..errors import MinferError
from ..formats import convert
from ..model import EMBEDDING_PLACES
from ..parallel import SINGLE, Sharding
from ..sparsity import prune_model_
from . import e2e_suite, report
from .arg_types import density_list, matrix_shape_list, positive_int
from .cases_macko import LLAMA2_7B_SHAPES, macko_bytes, pruned_arrays, rotated
from .suites import Suite, SuiteRun, register
from .timing import copy_bandwidth_gbs, elapsed_ms, rotation_count, time_graph, warm_up

SECTIONS = ("spmv", "sweep", "spmm", "decompress")  # kernel sections; "e2e" runs the model
STUDY_SECTIONS = ("spmv", "spmm", "decompress")  # apps/benchmark.py --suite macko: all but the long sweep
E2E_DENSITIES = (1.0, 0.7, 0.5, 0.3, 0.1)
DENSITIES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
SWEEP_DENSITIES = (0.1, 0.3, 0.5, 0.7)
SWEEP = [dict(steps=s, warps_per_block=w, x_in_smem=m) for s in (1, 2) for w in (4, 8, 16) for m in (1, 0)]
SPMM_TOKENS = (2, 4, 8, 12, 16)
SPMM_DENSITIES = (0.3, 0.5)
DECOMPRESS_DENSITIES = (0.5,)
REFERENCE_SCHEDULE = dict(steps=1, warps_per_block=16, x_in_smem=0, pipeline=0)

COLUMNS = {
    "spmv": [report.Column(*c) for c in [
        ("shape", "shape"), ("density", "d", "{:g}"), ("mb", "MACKO MB", "{:.1f}"),
        ("minfer_ms", "minfer ms", "{:.4f}"), ("gbs", "GB/s", "{:.0f}"), ("pct_copy", "% copy", "{:.1f}"),
        ("ref_schedule_ms", "ref-sched ms", "{:.4f}"), ("vs_ref_schedule", "vs ref", "{:.2f}x"),
        ("cublas_ms", "cuBLAS ms", "{:.4f}"), ("vs_cublas", "vs cuBLAS", "{:.2f}x"),
        ("gemv_ms", "minfer gemv ms", "{:.4f}"), ("csr_ms", "CSR ms", "{:.4f}"), ("vs_csr", "vs CSR", "{:.1f}x"),
        ("reference_ms", "dense ref ms", "{:.3f}"), ("vs_reference", "vs dense ref", "{:.1f}x")]],
    "sweep": [report.Column(*c) for c in [
        ("shape", "shape"), ("density", "d", "{:g}"), ("config", "steps/warps/x-in-smem"),
        ("minfer_ms", "ms", "{:.4f}"), ("pct_copy", "% copy", "{:.1f}")]],
    "spmm": [report.Column(*c) for c in [
        ("shape", "shape"), ("density", "d", "{:g}"), ("tokens", "T"), ("cuda_core_ms", "CUDA-core ms", "{:.4f}"),
        ("tensor_core_ms", "tensor-core ms", "{:.4f}"), ("path", "minfer takes"), ("minfer_ms", "minfer ms", "{:.4f}"),
        ("pct_copy", "% copy", "{:.1f}"), ("vs_spmv", "x SpMV time", "{:.2f}"),
        ("cublas_ms", "cuBLAS ms", "{:.4f}"), ("vs_cublas", "vs cuBLAS", "{:.2f}x")]],
    "decompress": [report.Column(*c) for c in [
        ("shape", "shape"), ("density", "d", "{:g}"), ("minfer_ms", "ms", "{:.4f}"), ("gbs", "GB/s", "{:.0f}"),
        ("pct_copy", "% copy", "{:.1f}")]],
    "e2e": [report.Column(*c) for c in [
        ("model", "model"), ("tp", "TP"), ("format", "weights"), ("embedding", "embedding"),
        ("weight_gb", "weights GB", "{:.2f}"),
        ("decode_tok_s", "decode tok/s", "{:.1f}"), ("vs_dense", "vs dense", "{:.2f}x"),
        ("weight_gb_s", "weights GB/s", "{:.0f}"), ("pct_copy", "% copy", "{:.1f}"),
        ("prefill_ms", "prefill ms", "{:.1f}"), ("peak_mem_gb", "peak GB/GPU", "{:.2f}")]],
}


def time_eager(run: Callable[[int], None], copies: int, replays: int = 10) -> float:
    """Median ms of one call of `run(i)`, the calls launched back to back outside any graph, after
    a warm-up (`timing.warm_up`)."""

    def run_all() -> None:
        for i in range(copies):
            run(i)

    warm_up(run_all, copies)
    return statistics.median(elapsed_ms(run_all) / copies for _ in range(replays))


class Matrix:
    """One pruned Llama matrix: its MACKO arrays and sizes, with rotated copies made on demand."""

    def __init__(self, n: int, k: int, density: float, dtype: torch.dtype):
        self.n, self.k, self.density, self.dtype = n, k, density, dtype
        self.arrays, self.nonzeros = pruned_arrays(n, k, density, dtype)
        self.shape = f"{n}x{k}"

    def bytes(self, tokens: int) -> int:
        return macko_bytes(self.arrays[0], self.arrays[2], self.n, self.k, tokens)

    def dense(self) -> torch.Tensor:
        return ops.macko_decompress(*self.arrays, cols=self.k)

    def time_macko(self, tokens: int, replays: int, tensor_cores: bool = False, **knobs) -> float:
        """ops.macko_spmv as given (no window table: the CUDA-core kernel for 2-16 tokens), or with
        `tensor_cores` the tensor-core SpMM at any token count (macko_spmv takes it from
        MACKO_TENSOR_CORE_MIN_TOKENS when given the table); launch `knobs` go to the *_tuned op."""
        table = ops.macko_window_table(*self.arrays, self.k) if tensor_cores else None  # one for every copy
        copies = rotation_count(self.bytes(tokens) + (table.numel() * 4 if tensor_cores else 0))
        macko = rotated(self.arrays, copies)
        x = torch.randn(tokens, self.k, device="cuda", dtype=self.dtype)
        out = torch.empty(tokens, self.n, device="cuda", dtype=self.dtype)
        if tensor_cores:
            spmm = ops.macko_tensor_core_spmm_tuned if knobs else ops.macko_tensor_core_spmm
            return time_graph(lambda i: spmm(*macko[i], table, x, out, **knobs), copies, replays=replays)
        spmv = ops.macko_spmv_tuned if knobs else ops.macko_spmv
        return time_graph(lambda i: spmv(*macko[i], x, out=out, **knobs), copies, replays=replays)

    def time_dense(self, tokens: int, replays: int, op: Callable) -> float:
        weights = rotated((self.dense(),), rotation_count(2 * self.n * self.k))
        x = torch.randn(tokens, self.k, device="cuda", dtype=self.dtype)
        return time_graph(lambda i: op(x, weights[i][0]), len(weights), replays=replays)

    def time_csr(self, replays: int) -> float:
        dense = self.dense()
        csr = dense.to_sparse_csr()
        csr = torch.sparse_csr_tensor(csr.crow_indices().int(), csr.col_indices().int(), csr.values(), dense.shape)
        del dense
        csr_bytes = csr.values().numel() * (csr.values().element_size() + 4) + 4 * (self.n + 1)
        copies = [csr] + [csr.clone() for _ in range(rotation_count(csr_bytes) - 1)]
        x = torch.randn(self.k, 1, device="cuda", dtype=self.dtype)
        return time_eager(lambda i: copies[i] @ x, len(copies), replays)

    def time_reference(self, replays: int) -> float:
        x = torch.randn(1, self.k, device="cuda", dtype=self.dtype)
        return time_eager(lambda i: ops.macko_spmv_reference(*self.arrays, x), 1, replays)

    def time_decompress(self, replays: int) -> float:
        copies = rotation_count(self.bytes(0) + 2 * self.n * self.k)
        macko = rotated(self.arrays, copies)
        out = torch.empty(self.n, self.k, device="cuda", dtype=self.dtype)
        return time_graph(lambda i: ops.macko_decompress(*macko[i], out=out), copies, replays=replays)


def bandwidth(nbytes: int, ms: float, copy_gbs: float) -> tuple[float, float]:
    gbs = nbytes / (ms * 1e-3) / 1e9
    return gbs, 100 * gbs / copy_gbs


def spmv_rows(m: Matrix, copy_gbs: float, replays: int) -> dict:
    ms = m.time_macko(1, replays)
    ref_ms = m.time_macko(1, replays, **REFERENCE_SCHEDULE)
    cublas_ms = m.time_dense(1, replays, F.linear)
    gemv_ms = m.time_dense(1, replays, ops.gemv)
    csr_ms = m.time_csr(replays)
    reference_ms = m.time_reference(max(3, replays // 4))
    gbs, pct = bandwidth(m.bytes(1), ms, copy_gbs)
    return {"shape": m.shape, "density": m.density, "mb": m.bytes(1) / 1e6, "minfer_ms": ms, "gbs": gbs,
            "pct_copy": pct, "ref_schedule_ms": ref_ms, "vs_ref_schedule": ref_ms / ms,
            "ref_schedule_pct_copy": bandwidth(m.bytes(1), ref_ms, copy_gbs)[1], "cublas_ms": cublas_ms,
            "cublas_pct_copy": bandwidth(2 * (m.n * m.k + m.n + m.k), cublas_ms, copy_gbs)[1],
            "vs_cublas": cublas_ms / ms, "gemv_ms": gemv_ms, "csr_ms": csr_ms, "vs_csr": csr_ms / ms,
            "reference_ms": reference_ms, "vs_reference": reference_ms / ms, "nonzeros": m.nonzeros}


def skipped_sections(sections, densities) -> list[str]:
    """What `run` leaves out at these densities: SpMM, decompression and the sweep run at their
    *_DENSITIES only."""
    notes = []
    if "spmm" in sections and not set(densities) & set(SPMM_DENSITIES):
        notes.append(f"SpMM runs at densities {', '.join(map(str, SPMM_DENSITIES))} only: none of these")
    if "decompress" in sections and not set(densities) & set(DECOMPRESS_DENSITIES):
        notes.append(f"decompression runs at densities {', '.join(map(str, DECOMPRESS_DENSITIES))} only: "
                     "none of these")
    if "sweep" in sections and not set(densities) & set(SWEEP_DENSITIES):
        notes.append(f"the sweep runs at densities {', '.join(map(str, SWEEP_DENSITIES))} only: none of these")
    return notes


def run(sections=SECTIONS, shapes=LLAMA2_7B_SHAPES, densities=DENSITIES, dtype=torch.float16, replays=20,
        on_row: Callable[[str, dict], None] = lambda section, row: None) -> tuple[float, dict[str, list[dict]]]:
    copy_gbs = copy_bandwidth_gbs()
    results: dict[str, list[dict]] = {s: [] for s in sections}
    if not sections:
        return copy_gbs, results

    def emit(section, row):
        results[section].append(row)
        on_row(section, row)

    for n, k in shapes:
        for density in densities:
            m = Matrix(n, k, density, dtype)
            if "spmv" in sections:
                emit("spmv", spmv_rows(m, copy_gbs, replays))
            if "sweep" in sections and density in SWEEP_DENSITIES:
                for knobs in SWEEP:
                    ms = m.time_macko(1, replays, **knobs)
                    emit("sweep", {"shape": m.shape, "density": density, **knobs, "minfer_ms": ms,
                                   "config": "{steps}/{warps_per_block}/{x_in_smem}".format(**knobs),
                                   "pct_copy": bandwidth(m.bytes(1), ms, copy_gbs)[1]})
            if "spmm" in sections and density in SPMM_DENSITIES:
                spmv_ms = m.time_macko(1, replays)
                for tokens in SPMM_TOKENS:
                    cuda_core_ms = m.time_macko(tokens, replays)
                    tensor_core_ms = m.time_macko(tokens, replays, tensor_cores=True)
                    tensor_cores = ops.macko_uses_tensor_cores(tokens)
                    ms = tensor_core_ms if tensor_cores else cuda_core_ms
                    cublas_ms = m.time_dense(tokens, replays, F.linear)
                    emit("spmm", {"shape": m.shape, "density": density, "tokens": tokens,
                                  "cuda_core_ms": cuda_core_ms, "tensor_core_ms": tensor_core_ms,
                                  "path": "tensor cores" if tensor_cores else "CUDA cores", "minfer_ms": ms,
                                  "pct_copy": bandwidth(m.bytes(tokens), ms, copy_gbs)[1], "vs_spmv": ms / spmv_ms,
                                  "cublas_ms": cublas_ms, "vs_cublas": cublas_ms / ms})
            if "decompress" in sections and density in DECOMPRESS_DENSITIES:
                ms = m.time_decompress(replays)
                gbs, pct = bandwidth(m.bytes(0) + 2 * n * k, ms, copy_gbs)
                emit("decompress", {"shape": m.shape, "density": density, "minfer_ms": ms, "gbs": gbs, "pct_copy": pct})
            del m
        torch.cuda.empty_cache()
    return copy_gbs, results


def e2e_rows(model_name: str, densities, prompt_tokens: int, new_tokens: int, dtype: torch.dtype, copy_gbs: float,
             on_row: Callable[[str, dict], None], embedding: str = "host", sharding: Sharding = SINGLE) -> list[dict]:
    """Decode speed and memory of a random-weight model, dense and pruned by magnitude to each density
    then stored as MACKO, on minfer's kernels (batch 1, the same prompt, EOS off; the token embedding
    on `embedding`, see Transformer.place_embedding). Peak memory counts from before the model is
    built, so what earlier suites of the same process still hold does not inflate it. Under tensor
    parallelism each rank prunes and compresses its own slices; memory and bandwidth are per GPU."""
    def prepare(density: float) -> Callable:
        def prune_and_convert(model) -> None:
            if density < 1.0:
                prune_model_(model, density, "magnitude")
                convert(model, "macko", progress=True)
        return prune_and_convert

    rows = []
    for density in densities:
        stats = e2e_suite.measure_format(model_name, dtype, prepare(density), prompt_tokens, new_tokens, embedding,
                                         sharding)
        row = {"model": model_name, "tp": sharding.world, "density": density,
               "format": "dense" if density == 1.0 else f"macko d={density}",
               **stats, "pct_copy": 100 * stats["weight_gb_s"] / copy_gbs}
        rows.append(row)
        on_row("e2e", {**row, "shape": model_name, "minfer_ms": 1e3 / stats["decode_tok_s"]})
    dense_tok_s = next((row["decode_tok_s"] for row in rows if row["density"] == 1.0), None)
    for row in rows:  # wherever 1.0 came in the list
        row["vs_dense"] = row["decode_tok_s"] / dense_tok_s if dense_tok_s else None
    return rows


def plot_e2e(path: str, rows: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(10, 4))
    densities = [r["density"] for r in rows]
    speed.plot(densities, [r["decode_tok_s"] for r in rows], "o-")
    speed.set(xlabel="density (1.0 = dense)", ylabel="decode tokens/s", title="decode speed")
    memory.plot(densities, [r["peak_mem_gb"] for r in rows], "o-", label="peak during generation")
    memory.plot(densities, [r["weight_gb"] for r in rows], "s--", label="weights")
    memory.set(xlabel="density (1.0 = dense)", ylabel="GB", title="memory")
    memory.legend()
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def study_shapes(shapes: list[str] | None) -> list[tuple[int, int]]:
    """--suite macko's --shapes as (N, K) pairs, Llama-2-7B's five when not given."""
    if not shapes:
        return LLAMA2_7B_SHAPES
    try:
        return matrix_shape_list(",".join(shapes))
    except argparse.ArgumentTypeError as e:
        raise MinferError(f"--shapes: {e}") from None


def study_step(bench: SuiteRun) -> dict:
    densities = bench.args.densities or DENSITIES
    for note in skipped_sections(STUDY_SECTIONS, densities):
        print(f"note: {note}")
    copy_gbs, rows = run(
        STUDY_SECTIONS, study_shapes(bench.args.shapes), densities, bench.dtype, bench.args.reps,
        on_row=lambda section, row: print(f"  macko {section} {row['shape']} d{row['density']}: "
                                          f"{row['minfer_ms']:.4f} ms", flush=True))
    bench.env["copy_gbs"] = round(copy_gbs, 1)
    return {"macko": rows}


def study_report(bench: SuiteRun) -> None:
    for section, rows in bench.results["macko"].items():
        report.print_table(f"MACKO {section} ({bench.env.get('device')}, {bench.args.dtype})", COLUMNS[section], rows)


def e2e_step(bench: SuiteRun) -> dict:
    args = bench.args
    copy_gbs = bench.copy_gbs()
    densities = args.densities or E2E_DENSITIES
    if 1.0 not in densities:
        print("note: no density 1.0 among --densities, so no dense row and no 'vs dense' column")
    return {"macko_e2e": e2e_rows(
        args.model, densities, args.prompt_tokens, args.new_tokens, bench.dtype, copy_gbs,
        on_row=lambda _, row: print(f"  macko e2e d={row['density']}: {row['decode_tok_s']:.1f} tok/s", flush=True),
        embedding=args.embedding, sharding=bench.sharding)}


def e2e_report(bench: SuiteRun) -> None:
    args = bench.args
    if bench.results["macko_e2e"]:
        report.print_table(f"MACKO end to end: {args.model}, random weights pruned by magnitude, batch 1, "
                           f"embedding on the {args.embedding}", COLUMNS["e2e"], bench.results["macko_e2e"])


def e2e_plot(bench: SuiteRun, path: str) -> bool:
    if not bench.results["macko_e2e"]:
        return False
    plot_e2e(path, bench.results["macko_e2e"], f"{bench.args.model}, random weights pruned by magnitude, "
                                                    f"batch 1, {bench.env.get('device')}")
    return True


register(Suite("macko", {"macko": dict}, study_step, study_report,
               help="the MACKO kernel study: SpMV against cuBLAS, torch CSR, the dense reference and the reference "
                    "kernel's schedule, then SpMM and decompression (also `python -m minfer.bench.macko_suite`, "
                    "with its launch sweep)",
               flags=("shapes", "densities", "reps"), check=lambda args: study_shapes(args.shapes)))
register(Suite("macko-e2e", {"macko_e2e": list}, e2e_step, e2e_report,
               flags=("densities", "plot", "model", "prompt_tokens", "new_tokens", "embedding"), alone_flags=("tp",),
               e2e=True, in_all=True, plot=e2e_plot))


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m minfer.bench.macko_suite", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    parser.add_argument("--shapes", type=matrix_shape_list, default=None,
                        help="comma list of NxK (default: the Llama-2-7B shapes)")
    parser.add_argument("--densities", type=density_list, default=None,
                        help="comma list (default: 0.1,...,0.9; e2e: 1.0,0.7,0.5,0.3,0.1, 1.0 meaning dense)")
    parser.add_argument("--reps", type=positive_int, default=20, help="timed replays per measurement (median)")
    parser.add_argument("--model", default="llama2-7b", help="e2e: known model alias, random weights")
    parser.add_argument("--prompt-tokens", type=positive_int, default=512, help="e2e prompt length (default 512)")
    parser.add_argument("--new-tokens", type=positive_int, default=256, help="e2e decoded tokens (default 256)")
    parser.add_argument("--embedding", choices=EMBEDDING_PLACES, default="host",
                        help="e2e: where minfer keeps the token embedding (default host: pinned memory, "
                             "one row read per step over PCIe)")
    parser.add_argument("--json", metavar="PATH", help="write the environment and every row as JSON")
    parser.add_argument("--plot", metavar="PATH", help="e2e: write a PNG of decode speed and memory per density")
    args = parser.parse_args(argv)
    return run_study(parser, args, {*SECTIONS, "e2e"}, "the MACKO study", study)


def run_study(parser: argparse.ArgumentParser, args: argparse.Namespace, known: set[str], what: str,
              study: Callable[[argparse.Namespace, list[str]], int]) -> int:
    """`study(args, sections)` for the comma list --sections (each in `known`; else a usage error), on the
    GPU with the kernels built; without a GPU, or on bad input, one `error:` line and exit status 2."""
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - known
    if unknown or not sections:
        parser.error(f"unknown section(s) {', '.join(sorted(unknown)) or repr(args.sections)}")
    if not torch.cuda.is_available():
        print(f"error: {what} needs a CUDA GPU", file=sys.stderr)
        return 2
    ops.build()
    try:
        return study(args, sections)
    except MinferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def study(args: argparse.Namespace, sections: list[str]) -> int:
    shapes = args.shapes or LLAMA2_7B_SHAPES
    densities = args.densities or DENSITIES
    for note in skipped_sections(sections, densities):
        print(f"note: {note}")
    env = report.environment()
    report.print_environment(env)
    done: dict[str, list[dict]] = {s: [] for s in sections}

    def on_row(section: str, row: dict) -> None:
        print(f"  {section} {row['shape']} d{row['density']}: {row['minfer_ms']:.4f} ms", flush=True)
        done[section].append(row)
        if args.json:  # rewritten after every row, so a run cut short keeps what it measured
            report.write_json(args.json, env, done)

    kernel_sections = [s for s in sections if s != "e2e"]
    copy_gbs, results = run(kernel_sections, shapes, densities, replays=args.reps, on_row=on_row)
    if "e2e" in sections:
        done["e2e"] = []
        results["e2e"] = e2e_rows(args.model, args.densities or E2E_DENSITIES, args.prompt_tokens, args.new_tokens,
                                  torch.float16, copy_gbs, on_row, args.embedding)
        if args.plot:
            plot_e2e(args.plot, results["e2e"], f"{args.model}, random weights pruned by magnitude, batch 1, "
                                                f"{env.get('device')}")
    return print_study("MACKO", env, copy_gbs, results, COLUMNS, args.json)


def print_study(title: str, env: dict, copy_gbs: float, results: dict[str, list[dict]],
                columns: dict[str, list[report.Column]], json_path: str | None) -> int:
    """A study's tables, one per section (and its JSON when asked); exit status 0."""
    env["copy_gbs"] = round(copy_gbs, 1)
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    for section, rows in results.items():
        report.print_table(f"{title} {section} ({env.get('device')})", columns[section], rows)
    if json_path:
        report.write_json(json_path, env, results)
        print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
