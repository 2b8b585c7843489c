"""The kernel benchmark: a registry of cases, each timed against its vendor baseline in the same run.

An op owner adds cases in their own module `minfer/bench/cases_<name>.py` (found automatically):

    from .kernel_suite import KernelCase, register

    def my_cases(dtype):
        return [KernelCase(op="my_op", shape="4096x4096", dtype=dtype, bytes=..., flops=..., build=...)]

    register("my_op", my_cases)

`build(copies)` allocates `copies` input sets (so the timed loop reads past L2) and returns
`(ours, baseline)`: callables that launch the op on input set i. Both are captured in a CUDA graph
by `minfer.bench.timing.time_graph`, so they must not sync or allocate outside torch's allocator.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import MinferError
from . import report
from .report import Column
from .suites import Suite, SuiteRun
from .suites import register as register_suite
from .timing import copy_bandwidth_gbs, rotation_count, time_graph

Runner = Callable[[int], None]


@dataclass(frozen=True)
class KernelCase:
    op: str
    # label; its first word is what --shapes matches ("4096x11008 t8" matches "4096x11008"); an op swept over
    # densities labels each case " d<density> " (apps/profile.py --density picks them)
    shape: str
    dtype: torch.dtype
    bytes: int  # the fewest bytes the op must move: each input read once, each output written once
    flops: int
    build: Callable[[int], tuple[Runner, Runner | None]]
    baseline: str = "torch"  # what the baseline runs, for the table
    # "memory": judged by GB/s against the copy rate; "compute": by TFLOP/s; "latency": small ops whose
    # data sits in L2 (argmax over one step's logits), judged by time alone
    bound: str = "memory"


CaseFactory = Callable[[torch.dtype], list[KernelCase]]
_factories: dict[str, CaseFactory] = {}
_densities: dict[str, tuple[float, ...]] = {}

COLUMNS = [
    Column("op", "op"),
    Column("shape", "shape"),
    Column("dtype", "dtype"),
    Column("minfer_ms", "minfer ms", "{:.4f}"),
    Column("baseline", "baseline"),
    Column("baseline_ms", "baseline ms", "{:.4f}"),
    Column("gbs", "GB/s", "{:.0f}"),
    Column("pct_copy", "% copy BW", "{:.1f}"),
    Column("tflops", "TFLOP/s", "{:.1f}"),
    Column("speedup", "speedup", "{:.2f}x"),
]


def register(op: str, factory: CaseFactory, densities: tuple[float, ...] = ()) -> None:
    """Make `op` selectable; `factory(dtype)` lists its cases, at `densities` for an op swept over them."""
    _factories[op] = factory
    _densities[op] = densities


def _discover() -> None:
    for info in pkgutil.iter_modules([str(Path(__file__).resolve().parent)]):
        if info.name.startswith("cases_"):
            importlib.import_module(f"minfer.bench.{info.name}")


def registered_ops() -> list[str]:
    _discover()
    return sorted(_factories)


def op_densities(op: str) -> tuple[float, ...]:
    """The densities `op`'s cases sweep (none for an op on dense or unpruned data)."""
    _discover()
    return _densities.get(op, ())


def select(ops: list[str] | None = None, shapes: list[str] | None = None,
           dtype: torch.dtype = torch.float16) -> list[KernelCase]:
    """The cases of `ops` (all when None) whose shape label starts with one of `shapes` (all when None)."""
    known = registered_ops()
    unknown = sorted(set(ops or []) - set(known))
    if unknown:
        raise MinferError(f"unknown op(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    cases = [case for op in (ops or known) for case in _factories[op](dtype)]
    if shapes:
        def matches(case, shape):
            return shape in (case.shape, case.shape.split()[0])

        missing = [shape for shape in shapes if not any(matches(case, shape) for case in cases)]
        if missing:
            labels = ", ".join(dict.fromkeys(case.shape.split()[0] for case in cases))
            raise MinferError(f"no case has shape {', '.join(missing)}; the shapes are {labels}")
        cases = [case for case in cases if any(matches(case, shape) for shape in shapes)]
    return cases


def measure(case: KernelCase, copy_gbs: float, replays: int = 20) -> dict:
    """Time one case and its baseline; returns a table row."""
    copies = rotation_count(case.bytes)
    ours, baseline = case.build(copies)
    ms = time_graph(ours, copies, replays=replays)
    baseline_ms = time_graph(baseline, copies, replays=replays) if baseline is not None else None
    del ours, baseline
    torch.cuda.empty_cache()

    def gbs(t):
        return None if t is None else case.bytes / (t * 1e-3) / 1e9

    memory_bound = case.bound == "memory"
    return {
        "op": case.op,
        "shape": case.shape,
        "dtype": str(case.dtype).removeprefix("torch."),
        "bound": case.bound,
        "bytes": case.bytes,
        "flops": case.flops,
        "copies": copies,
        "minfer_ms": ms,
        "baseline": case.baseline if baseline_ms is not None else None,
        "baseline_ms": baseline_ms,
        "gbs": gbs(ms),
        "baseline_gbs": gbs(baseline_ms),
        "pct_copy": 100 * gbs(ms) / copy_gbs if memory_bound else None,
        "baseline_pct_copy": 100 * gbs(baseline_ms) / copy_gbs if memory_bound and baseline_ms else None,
        "tflops": case.flops / (ms * 1e-3) / 1e12 if case.flops else None,
        "speedup": baseline_ms / ms if baseline_ms else None,
    }


def run(ops: list[str] | None = None, shapes: list[str] | None = None, dtype: torch.dtype = torch.float16,
        replays: int = 20, on_row: Callable[[dict], None] | None = None) -> tuple[float, list[dict]]:
    """Measure the copy-bandwidth ceiling, then every selected case; returns (copy GB/s, rows)."""
    cases = select(ops, shapes, dtype)
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for case in cases:
        row = measure(case, copy_gbs, replays)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return copy_gbs, rows


def run_step(bench: SuiteRun) -> dict:
    copy_gbs, rows = run(
        bench.args.ops, bench.args.shapes, bench.dtype, bench.args.reps,
        on_row=lambda row: print(f"  {row['op']} {row['shape']}: {row['minfer_ms']:.4f} ms", flush=True))
    bench.env["copy_gbs"] = round(copy_gbs, 1)
    return {"kernels": rows}


def report_step(bench: SuiteRun) -> None:
    if bench.results["kernels"]:
        report.print_table(f"kernels ({bench.env.get('device')}, {bench.args.dtype})", COLUMNS,
                           bench.results["kernels"])


register_suite(Suite("kernels", {"kernels": list}, run_step, report_step, flags=("ops", "shapes", "plot", "reps"),
                     in_all=True, plot=report.plot_kernels_and_e2e))
