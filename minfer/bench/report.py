"""Benchmark output: the environment a number was measured in, a table, JSON, and a PNG plot."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..errors import MinferError

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    fmt: str = "{}"  # applied to the value; None prints as an em dash


def git_commit() -> str:
    """$MINFER_COMMIT when set (a copied tree has no .git), else HEAD with '-dirty' for local edits."""
    if os.environ.get("MINFER_COMMIT"):
        return os.environ["MINFER_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def environment() -> dict:
    env = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(device=props.name, sm_count=props.multi_processor_count,
                   l2_mb=round(props.L2_cache_size / 2**20, 1), memory_gb=round(props.total_memory / 1e9, 1),
                   capability=f"{props.major}.{props.minor}")
    return env


def format_cell(value, fmt: str) -> str:
    return "—" if value is None else fmt.format(value)


def print_table(title: str, columns: list[Column], rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col.header, justify="left" if col.fmt == "{}" else "right")
    for row in rows:
        table.add_row(*(format_cell(row.get(col.key), col.fmt) for col in columns))
    Console(width=200).print(table)


def print_environment(env: dict) -> None:
    print(", ".join(f"{key} {value}" for key, value in env.items()))


def write_json(path: str | Path, env: dict, suites: dict[str, list[dict]]) -> None:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"environment": env, **suites}, indent=2, default=str) + "\n")
    except OSError as exc:
        raise MinferError(f"cannot write {path}: {exc.strerror or exc}") from None


def plot(path: str | Path, env: dict, kernel_rows: list[dict], e2e_rows: list[dict]) -> None:
    """Kernels: speedup over the vendor baseline and, for memory-bound ones, % of copy bandwidth.
    End to end: tokens/s per backend and phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    if kernel_rows:
        panels += ["speedup", "bandwidth"]
    if e2e_rows:
        panels.append("e2e")
    if not panels:
        return
    height = max(3.0, 0.32 * len(kernel_rows) + 1.5)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), height), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "speedup":
            rows = [r for r in kernel_rows if r.get("speedup") is not None]
            labels = [f"{r['op']} {r['shape']}" for r in rows]
            ax.barh(labels, [r["speedup"] for r in rows], color="tab:blue")
            ax.axvline(1.0, color="black", linewidth=0.8)
            ax.set_xlabel("speedup over the vendor baseline (x)")
            ax.invert_yaxis()
        elif panel == "bandwidth":
            rows = [r for r in kernel_rows if r.get("pct_copy") is not None]
            labels = [f"{r['op']} {r['shape']}" for r in rows]
            y = range(len(rows))
            ax.barh([i - 0.2 for i in y], [r["pct_copy"] for r in rows], height=0.4, label="minfer")
            ax.barh([i + 0.2 for i in y], [r.get("baseline_pct_copy") or 0 for r in rows], height=0.4,
                    label="baseline")
            ax.set_yticks(list(y), labels)
            ax.axvline(100.0, color="black", linewidth=0.8)
            ax.set_xlabel("% of device copy bandwidth")
            ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)
            ax.invert_yaxis()
        else:
            labels = [f"{r['backend']} {r['phase']}" for r in e2e_rows]
            ax.barh(labels, [r["tok_s"] for r in e2e_rows], color="tab:green")
            ax.set_xlabel("tokens / s")
            ax.invert_yaxis()
    fig.suptitle(f"{env.get('device', 'cpu')} · torch {env['torch']} · {env['commit']} · {env['date'][:10]}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_kernels_and_e2e(bench, path: str) -> bool:
    """The kernels and e2e suites' shared figure (`bench` is a suites.SuiteRun): one PNG for either or both."""
    kernel_rows, e2e_rows = bench.results["kernels"], bench.results["e2e"]
    if not (kernel_rows or e2e_rows):
        return False
    plot(path, bench.env, kernel_rows, e2e_rows)
    return True
