"""The benchmark suite registry and apps/benchmark.py's wiring of every registered suite, on the CPU:
each suite's GPU measuring functions stand in with fixed rows, so its run, report, JSON and plot steps
run as they would on a GPU."""

import json
from pathlib import Path

import pytest
import torch

from minfer import ops
from minfer.bench import attention_suite, e2e_suite, kernel_suite, ksmm_suite, macko_suite, report, sparse24_suite
from minfer.bench import suites
from tests.helpers import load_app

BENCHMARK_APP = Path(__file__).resolve().parent.parent / "apps" / "benchmark.py"
COPY_GBS = 3000.0
ENV = {"date": "2026-01-01T00:00:00+00:00", "commit": "abc", "torch": torch.__version__, "device": "test GPU"}


def stand_in(result, *emitted):
    """A measuring function that hands `emitted` to its row callback (the `on_row` keyword, or the one
    callable among its arguments) and returns `result`."""
    def measure(*args, **kwargs):
        on_row = kwargs.get("on_row") or next(arg for arg in args if callable(arg))
        for row in emitted:
            on_row(*row)
        return result
    return measure


def kernel_stand_ins():
    row = {"op": "gemv", "shape": "4096x4096 t1", "minfer_ms": 0.01, "baseline_ms": 0.012, "speedup": 1.2,
           "pct_copy": 90.0, "baseline_pct_copy": 75.0}
    return {kernel_suite: {"run": stand_in((COPY_GBS, [row]), (row,))}}


def e2e_stand_ins():
    rows = [{"backend": backend, "phase": phase, "tok_s": 100.0} for backend in ("minfer", "torch")
            for phase in ("prefill", "decode")]
    return {e2e_suite: {"run": stand_in(rows, *((row,) for row in rows))}}


def macko_stand_ins():
    spmv = {"shape": "96x200", "density": 0.5, "minfer_ms": 0.02}
    return {macko_suite: {"run": stand_in((COPY_GBS, {"spmv": [spmv]}), ("spmv", spmv))}}


def macko_e2e_stand_ins():
    rows = [{"density": d, "decode_tok_s": 90.0 / d, "peak_mem_gb": 14 * d, "weight_gb": 13 * d} for d in (1.0, 0.5)]
    return {macko_suite: {"e2e_rows": stand_in(rows, *(("e2e", row) for row in rows))}}


def sparse24_stand_ins():
    row = {"shape": "4096x4096", "tokens": 1, "minfer_ms": 0.01}
    return {sparse24_suite: {"run": stand_in((COPY_GBS, {"decode": [row], "prefill": [row]}), ("decode", row)),
                             "e2e_rows": stand_in([{"format": "2:4", "decode_tok_s": 120.0}], ("e2e", row)),
                             "copy_bandwidth_gbs": lambda: COPY_GBS}}


def attention_stand_ins():
    prefill = {"layout": "dense", "seq_len": 4096, "minfer_ms": 1.5, "mma_ms": 1.7}
    decode = {"layout": "dense", "seq_len": 4096, "minfer_us": 20.0, "splits": 8, "splits_2": 25.0}
    fit = {"seq_len": 16384, "kept": [0.1, 1.0], "minfer_ms": [1.0, 9.0], "slope_ms": 8.9, "intercept_ms": 0.1,
           "r_squared": 0.99}
    ceilings = {"copy_gbs": COPY_GBS, "matmul_tflops": 700.0}
    return {attention_suite: {"run": stand_in((ceilings, [prefill], fit, [decode]), (prefill,), (decode,)),
                              "kernel_variants": lambda: ("mma",)}}


def ksmm_stand_ins():
    grid = [{"pattern": "(1,64,64,1)", "tokens": tokens, "speedup": 1.5, "factor_mb": 8.0, "pct_copy": 80.0,
             "path": "gemv", "minfer_ms": 0.01, "rows_ms": 0.02, "wgmma_ms": None, "best": "bmm"} for tokens in ksmm_suite.BATCHES]
    e2e = [{"format": fmt, "decode_tok_s": 100.0, "prefill_ms": 10.0} for fmt in ("dense", ksmm_suite.KS_PRESET)]
    wgmma = [{"pattern": "(4,1024,1024,1)", "tokens": 512, "wgmma_us": 9.0, "speedup": 1.7},
             {"pattern": "(4,1024,1024,1)", "tokens": 64, "threshold": True, "ring_us": 5.0, "wgmma_us": 4.0}]
    return {ksmm_suite: {"run": stand_in((COPY_GBS, grid, [{"tokens": 1}]), *((row,) for row in grid)),
                         "e2e_rows": stand_in(e2e, *((row,) for row in e2e)), "wgmma_runs": lambda: True,
                         "wgmma_rows": stand_in(wgmma, *((row,) for row in wgmma))}}


# Per registered suite: the stand-ins for its GPU functions (module -> name -> replacement), the tables
# it prints, and the files its plot writes beside --plot's bench.png.
STAND_INS = {
    "kernels": (kernel_stand_ins, ["kernels (test GPU, float16)"], ["bench.png"]),
    "e2e": (e2e_stand_ins, ["end to end: llama2-7b"], ["bench.png"]),
    "macko": (macko_stand_ins, ["MACKO spmv (test GPU, float16)"], []),
    "macko-e2e": (macko_e2e_stand_ins, ["MACKO end to end: llama2-7b"], ["bench.png"]),
    "sparse24": (sparse24_stand_ins, ["2:4 decode", "2:4 prefill", "2:4 e2e"], []),
    "attention": (attention_stand_ins, ["block-sparse prefill", "kernel variants", "block-sparse decode"],
                  ["bench.png"]),
    "ksmm": (ksmm_stand_ins, ["KS factors: grid", "KS factors: wgmma", "KS factors: summary", "KS factors: e2e"],
             ["bench.png"]),
}


@pytest.fixture
def no_gpu_needed(monkeypatch):
    """The app's GPU gates passed, and copy_bandwidth_gbs, as the suites' copy-rate getter calls it, fixed."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ops, "build", lambda: None)
    monkeypatch.setattr(report, "environment", lambda: dict(ENV))
    monkeypatch.setattr(suites, "copy_bandwidth_gbs", lambda: COPY_GBS)


def test_every_registered_suite_has_a_stand_in_here():
    assert list(suites.registered()) == list(STAND_INS)


def test_flags_apply_to_the_suites_that_name_them():
    app = load_app(BENCHMARK_APP)
    named = {flag for suite in suites.registered().values() for flag in suite.flags + suite.alone_flags}
    assert named <= set(app.SUITE_FLAGS)
    assert suites.flag_suites("tp") == ("e2e", "macko-e2e")  # taken alone, never through --suite all
    assert suites.flag_suites("densities") == ("macko", "macko-e2e", "all")
    assert [suite.name for suite in suites.chosen("all")] == ["kernels", "e2e", "macko-e2e"]


@pytest.mark.parametrize("name", [*STAND_INS, "all"])
def test_benchmark_app_wires_each_suite(name, tmp_path, monkeypatch, capsys, no_gpu_needed):
    """Run, tables, JSON and plot of `--suite name` with its GPU functions standing in."""
    chosen = [suite.name for suite in suites.chosen(name)]
    expected_tables, expected_plots = [], []
    for suite_name in chosen:
        stand_ins, tables, plots = STAND_INS[suite_name]
        for module, replacements in stand_ins().items():
            for attribute, replacement in replacements.items():
                monkeypatch.setattr(module, attribute, replacement)
        expected_tables += tables
        expected_plots += plots
    argv = ["--suite", name, "--json", str(tmp_path / "bench.json")]
    if name in suites.flag_suites("plot"):
        argv += ["--plot", str(tmp_path / "bench.png")]
    assert load_app(BENCHMARK_APP).main(argv) == 0
    out = capsys.readouterr().out
    for title in expected_tables:
        assert title in out, title
    assert f"device copy bandwidth: {COPY_GBS:.0f} GB/s" in out
    written = json.loads((tmp_path / "bench.json").read_text())
    keys = {key for suite in suites.registered().values() for key in suite.sections}
    assert set(written) == keys | {"environment"}
    for suite_name in chosen:
        assert all(written[key] for key in suites.registered()[suite_name].sections), suite_name
    # the kernels and e2e suites share one figure; a later one goes beside it, suffixed with its suite
    plots = sorted(path.name for path in tmp_path.glob("*.png"))
    assert plots == (["bench-macko-e2e.png", "bench.png"] if name == "all" else sorted(set(expected_plots)))
    for path in tmp_path.glob("*.png"):
        assert path.read_bytes()[:4] == b"\x89PNG"
