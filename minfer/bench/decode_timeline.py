"""Where a CUDA-graph decode step spends its time, kernel by kernel, from a CUPTI trace.

Kernels launched with programmatic dependent launch start early and wait, so a kernel's own
duration overstates what it costs. Each kernel completes after the one before it (every kernel
waits for its predecessor before it finishes), so the step's time splits exactly into the gaps
between consecutive kernel ends: that gap is what a kernel adds to the critical path. Kernels are
grouped by name and grid (a GEMV's grid tells its shape apart), and steps are cut at the sampling
kernel, which each decode step runs once.
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from .report import Column

STEP_MARKER = "argmax"  # the greedy sampling kernel ends every step

COLUMNS = [
    Column("kernel", "kernel"),
    Column("grid", "grid"),
    Column("calls", "calls/step", "{:.0f}"),
    Column("added_us", "added µs/call", "{:.2f}"),
    Column("own_us", "own µs/call", "{:.2f}"),
    Column("idle_us", "idle before µs", "{:.2f}"),
    Column("step_us", "µs/step", "{:.1f}"),
    Column("pct", "% of step", "{:.1f}"),
]


def short_name(name: str) -> str:
    """`void minfer::(anonymous namespace)::gemv_mma_kernel<__half, 8, 4>(...)` -> `gemv_mma_kernel<__half, 8, 4>`."""
    name = re.sub(r"^void ", "", name)
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # drop the parameter list: the first '(' outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and not name[i:].startswith("(anonymous"):
            cut = i
            break
    name = name[:cut]
    head, sep, args = name.partition("<")
    return head.split("::")[-1] + sep + args


def trace_kernels(run) -> list[dict]:
    """Runs `run()` under the CUDA profiler; returns its kernels as {name, grid, start, end} (µs), by end."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    kernels = [{"name": short_name(e["name"]), "grid": "x".join(str(v) for v in e.get("args", {}).get("grid", [])),
                "start": float(e["ts"]), "end": float(e["ts"]) + float(e["dur"])}
               for e in events if e.get("cat") == "kernel"]
    return sorted(kernels, key=lambda k: k["end"])


def split_steps(kernels: list[dict]) -> list[list[dict]]:
    """Kernel lists of whole steps: each ends with the step marker, the first (prefill) is dropped."""
    steps, current = [], []
    for kernel in kernels:
        current.append(kernel)
        if STEP_MARKER in kernel["name"]:
            steps.append(current)
            current = []
    return steps[1:]


def attribute(steps: list[list[dict]]) -> tuple[list[dict], float]:
    """Per (name, grid): calls per step, the median critical-path time each call adds (its end
    minus the previous kernel's end), its own duration, and the idle time before it starts."""
    added, idle, own, calls = defaultdict(list), defaultdict(list), defaultdict(list), defaultdict(int)
    step_times = []
    previous_end = None
    for step in steps:
        start = previous_end
        for kernel in step:
            key = (kernel["name"], kernel["grid"])
            if previous_end is not None:
                added[key].append(kernel["end"] - previous_end)
                idle[key].append(max(0.0, kernel["start"] - previous_end))
            own[key].append(kernel["end"] - kernel["start"])
            calls[key] += 1
            previous_end = kernel["end"]
        if start is not None:
            step_times.append(previous_end - start)
    step_us = statistics.median(step_times)
    rows = []
    for key, values in added.items():
        per_step = calls[key] / len(steps)
        per_call = statistics.median(values)
        rows.append({"kernel": key[0], "grid": key[1], "calls": per_step, "added_us": per_call,
                     "own_us": statistics.median(own[key]),
                     "idle_us": statistics.median(idle[key]), "step_us": per_call * per_step,
                     "pct": 100 * per_call * per_step / step_us})
    rows.sort(key=lambda r: -r["step_us"])
    return rows, step_us


def run(generator, prompt_ids: list[int], steps: int) -> tuple[list[dict], float]:
    """Traces `steps` graph-replayed decode steps of `generator` after a warm-up generation."""
    generator.eos_id = None
    generator.generate(prompt_ids, max_new_tokens=steps + 1)  # captures the graphs
    kernels = trace_kernels(lambda: generator.generate(prompt_ids, max_new_tokens=steps + 1))
    decode_steps = split_steps(kernels)
    if len(decode_steps) < 2:
        raise RuntimeError(f"the trace holds {len(decode_steps)} decode steps (no '{STEP_MARKER}' kernels?): "
                           "the profiler did not see the graph's kernels")
    return attribute(decode_steps)
