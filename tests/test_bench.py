"""Benchmark plumbing: case selection, the table, JSON and the plot (no GPU); the timing helpers and
the MACKO study app (GPU)."""

import argparse
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from minfer import ops
from minfer.bench import e2e_suite, kernel_suite, macko_suite, report, timing
from minfer.bench.arg_types import csv_list, density_list, matrix_shape_list, positive_int
from minfer.errors import MinferError
from tests.conftest import requires_cuda
from tests.helpers import load_app

BENCHMARK_APP = Path(__file__).resolve().parent.parent / "apps" / "benchmark.py"


def test_registry_finds_the_case_modules_and_filters_by_shape():
    assert {"gemv", "argmax"} <= set(kernel_suite.registered_ops())
    cases = kernel_suite.select(["gemv"], ["4096x11008"], torch.float16)
    assert [case.shape for case in cases] == ["4096x11008 t1", "4096x11008 t8"]
    assert cases[0].bytes == 2 * (4096 * 11008 + 11008 + 4096)
    with pytest.raises(MinferError, match="unknown op"):
        kernel_suite.select(["no_such_op"])
    with pytest.raises(MinferError, match="no case has shape"):
        kernel_suite.select(["gemv"], ["3x3"])
    with pytest.raises(MinferError, match="no case has shape 32000x4069;"):  # a typo beside a real shape
        kernel_suite.select(["gemv"], ["4096x11008", "32000x4069"])


def test_table_json_and_plot(tmp_path, capsys):
    env = {"date": "2026-01-01T00:00:00+00:00", "commit": "abc", "torch": torch.__version__, "device": "test"}
    kernel_rows = [
        {"op": "gemv", "shape": "4096x4096 t1", "dtype": "float16", "minfer_ms": 0.01, "baseline": "F.linear",
         "baseline_ms": 0.012, "gbs": 3000.0, "pct_copy": 91.0, "baseline_pct_copy": 80.0, "tflops": 3.0,
         "speedup": 1.2},
        {"op": "sample_top_k", "shape": "1x32000", "dtype": "float16", "minfer_ms": 0.05, "baseline": None,
         "baseline_ms": None, "gbs": 1.0, "pct_copy": None, "tflops": None, "speedup": None},
    ]
    e2e_rows = [{"model": "m", "backend": b, "phase": p, "tokens": 1, "ms": 1.0, "tok_s": t, "gb_s": None,
                 "pct_copy": None, "speedup": 1.0} for b, p, t in [("minfer", "decode", 300.0), ("torch", "decode", 200.0)]]
    report.print_table("kernels", kernel_suite.COLUMNS, kernel_rows)
    report.print_table("e2e", e2e_suite.COLUMNS, e2e_rows)
    printed = capsys.readouterr().out
    assert "4096x4096 t1" in printed and "1.20x" in printed and "—" in printed
    report.write_json(tmp_path / "bench.json", env, {"kernels": kernel_rows, "e2e": e2e_rows})
    assert json.loads((tmp_path / "bench.json").read_text())["kernels"][0]["speedup"] == 1.2
    report.plot(tmp_path / "bench.png", env, kernel_rows, e2e_rows)
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_environment_names_the_commit(monkeypatch):
    """The commit of the checkout (HEAD, "-dirty" with local edits), or $MINFER_COMMIT for a copied tree."""
    monkeypatch.delenv("MINFER_COMMIT", raising=False)
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=report.REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git, or this tree is a copy without .git: the commit can only come from $MINFER_COMMIT")
    env = report.environment()
    assert re.fullmatch(re.escape(head) + "(-dirty)?", env["commit"]), env["commit"]
    assert env["torch"] == torch.__version__
    monkeypatch.setenv("MINFER_COMMIT", "0123abc")
    assert report.environment()["commit"] == "0123abc"


def test_density_and_shape_arguments():
    assert density_list("0.5,1.0") == [0.5, 1.0]
    assert matrix_shape_list("4096x11008,32000x4096") == [(4096, 11008), (32000, 4096)]
    for bad in ("0", "1.5", "half", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="densities must be"):
            density_list(bad)
    for bad in ("4096", "0x8", "8x-1", "axb", ",", "", "12x", "\u00b2x4", "8x8,,8x8"):
        with pytest.raises(argparse.ArgumentTypeError, match="NxK"):
            matrix_shape_list(bad)
    for bad in ("", ",", "gemv,,argmax"):
        with pytest.raises(argparse.ArgumentTypeError, match="no empty items"):
            csv_list(bad)
    assert positive_int("3") == 3
    for bad, message in (("0", "at least 1"), ("-2", "at least 1"), ("2.5", "whole number")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            positive_int(bad)


@pytest.mark.parametrize("argv, message", [
    (["--suite", "e2e", "--densities", "0.5"], "--densities does not apply to --suite e2e"),
    (["--suite", "kernels", "--densities", "0.5"], "--densities does not apply to --suite kernels"),
    (["--suite", "macko", "--plot", "out.png"], "--plot does not apply to --suite macko"),
    (["--suite", "macko-e2e", "--shapes", "4096x4096"], "--shapes does not apply to --suite macko-e2e"),
    (["--suite", "macko", "--ops", "gemv"], "--ops does not apply to --suite macko"),
    (["--suite", "kernels", "--model", "llama2-7b"], "--model does not apply to --suite kernels"),
    (["--suite", "macko", "--prompt-tokens", "9"], "--prompt-tokens does not apply to --suite macko"),
    (["--suite", "kernels", "--new-tokens", "3"], "--new-tokens does not apply to --suite kernels"),
    (["--suite", "macko", "--embedding", "gpu"], "--embedding does not apply to --suite macko"),
    (["--suite", "e2e", "--reps", "5"], "--reps does not apply to --suite e2e"),
    (["--suite", "kernels", "--tp", "2"], "--tp does not apply to --suite kernels"),
    (["--suite", "e2e", "--model", "no-such-model"], "--model: "),
    (["--suite", "macko-e2e", "--prompt-tokens", "4000", "--new-tokens", "200"], "exceeds the 4096 positions"),
    (["--suite", "kernels", "--json", "/proc/no/such.json"], "--json /proc/no/such.json"),
    (["--suite", "kernels", "--phases", "decode"], "--phases does not apply to --suite kernels"),
    (["--suite", "attention", "--phases", "decode,backward"], "--phases: choose among prefill,decode"),
    (["--suite", "attention", "--context", "32768"], "--context does not apply to --suite attention"),
    (["--suite", "e2e", "--attention", "blocksparse"], "--attention blocksparse and --layout go together"),
    (["--suite", "e2e", "--layout", "causal"], "--attention blocksparse and --layout go together"),
    (["--suite", "e2e", "--attention", "blocksparse", "--layout", "banded"], "unknown layout 'banded'"),
    (["--suite", "e2e", "--context", "32768", "--prompt-tokens", "9"], "drop --prompt-tokens"),
    (["--suite", "e2e", "--context", "65536"], "--context must exceed --new-tokens 256 and be at most 32768"),
])
def test_benchmark_app_refuses_flags_its_suite_would_ignore(argv, message, capsys):
    assert load_app(BENCHMARK_APP).main(argv) == 2
    assert message in capsys.readouterr().err


def test_attention_cases_are_registered_for_the_profiler():
    cases = kernel_suite.select(["attention"], ["decode"], torch.float16)
    assert [case.shape.split()[0] for case in cases] == ["decode"]
    # sink 128 + window 2048 at blocks of 128 and the query in the cache's last block: 1 + 17 blocks of 128
    # positions, for 8 KV heads, K and V, 128 dims of 2 bytes
    assert cases[0].bytes == 18 * 128 * 8 * 2 * 128 * 2 + 2 * 32 * 128 * 2


def test_macko_study_says_which_sections_its_densities_skip():
    assert macko_suite.skipped_sections(macko_suite.STUDY_SECTIONS, [0.5]) == []
    notes = macko_suite.skipped_sections(macko_suite.STUDY_SECTIONS, [0.7])
    assert len(notes) == 2 and "SpMM runs at densities 0.3, 0.5 only" in notes[0] and "0.5 only" in notes[1]


def test_benchmark_app_makes_the_output_folders_before_it_runs(tmp_path, capsys, monkeypatch):
    """--json and --plot folders are made (and checked) before any suite runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # stop right after the checks
    monkeypatch.setenv("HOME", str(tmp_path))
    json_path, plot_path = tmp_path / "a" / "b.json", tmp_path / "c" / "d.png"
    assert load_app(BENCHMARK_APP).main(["--json", "~/a/b.json", "--plot", str(plot_path)]) == 2
    assert json_path.parent.is_dir() and plot_path.parent.is_dir()
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_benchmark_app_refuses_zero_replays(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_app(BENCHMARK_APP).main(["--reps", "0"])
    assert exit_info.value.code == 2 and "--reps" in capsys.readouterr().err


def test_benchmark_app_rejects_a_bad_macko_shape(capsys):
    assert load_app(BENCHMARK_APP).main(["--suite", "macko", "--shapes", "4096"]) == 2
    assert "--shapes: shapes must be NxK" in capsys.readouterr().err


@requires_cuda
@pytest.mark.parametrize("calls_per_replay", [1, 7])
def test_warm_up_runs_for_its_count_and_its_time(calls_per_replay):
    """Timing starts only after WARMUP_CALLS calls and WARMUP_MS (a fresh matrix's first calls are slow)."""
    replays = []
    start = time.perf_counter()
    timing.warm_up(lambda: replays.append(torch.ones(1, device="cuda")), calls_per_replay)
    assert len(replays) * calls_per_replay >= timing.WARMUP_CALLS
    assert (time.perf_counter() - start) * 1e3 >= timing.WARMUP_MS


@requires_cuda
def test_time_graph_fills_each_replay_and_counts_every_call():
    """A short op is captured in rounds over its copies until a replay holds MIN_REPLAY_MS of work;
    the time is per call, so an op of two launches takes about twice as long as one of one."""
    x = torch.randn(1 << 20, device="cuda")
    copies = [x.clone() for _ in range(3)]
    seen = []

    def one(i):
        seen.append(i)
        copies[i].mul_(1.0)

    one_ms = timing.time_graph(one, 3, replays=5)
    assert len(seen) > 3 + 3 and set(seen) == {0, 1, 2}  # eager pass, a first capture, then more rounds
    two_ms = timing.time_graph(lambda i: (copies[i].mul_(1.0), copies[i].mul_(1.0)), 3, replays=5)
    assert 1.5 < two_ms / one_ms < 2.5


@requires_cuda
@pytest.mark.parametrize("op", ["gemv_fused", "macko_fused"])
def test_fused_cases_compute_what_their_torch_baselines_compute(op):
    """Each fused decode case (the norm, silu(gate) * up or the residual add inside the projection)
    and its torch baseline give the same output, so the suite times the same work on both sides."""
    for case in kernel_suite.select([op], None, torch.float16):
        ours, baseline = case.build(2)
        out = ours(0)
        out.zero_()  # the residual of the "add" cases starts at zero on both sides
        mine = ours(0).clone()
        out.zero_()
        theirs = baseline(0).clone()
        torch.testing.assert_close(mine, theirs, atol=2e-2, rtol=2e-2, msg=lambda m: f"{case.shape}: {m}")


@requires_cuda
def test_benchmark_app_macko_suite_reports_every_baseline(tmp_path):
    """`--suite macko` runs the MACKO study's SpMV (with torch CSR, the dense reference and the
    reference schedule), SpMM and decompression sections and writes them to --json."""
    out = tmp_path / "macko.json"
    assert load_app(BENCHMARK_APP).main(["--suite", "macko", "--shapes", "96x200", "--densities", "0.5",
                                         "--reps", "2", "--json", str(out)]) == 0
    macko = json.loads(out.read_text())["macko"]
    (spmv,) = macko["spmv"]
    assert spmv["shape"] == "96x200" and spmv["density"] == 0.5
    for key in ("minfer_ms", "cublas_ms", "csr_ms", "reference_ms", "ref_schedule_ms"):
        assert spmv[key] > 0, key
    assert spmv["vs_reference"] == pytest.approx(spmv["reference_ms"] / spmv["minfer_ms"])
    assert [row["tokens"] for row in macko["spmm"]] == [2, 4, 8, 12, 16]
    for row in macko["spmm"]:
        assert row["cuda_core_ms"] > 0 and row["tensor_core_ms"] > 0
        tensor_cores = row["tokens"] >= ops.MACKO_TENSOR_CORE_MIN_TOKENS
        assert row["minfer_ms"] == row["tensor_core_ms" if tensor_cores else "cuda_core_ms"]
    assert len(macko["decompress"]) == 1
