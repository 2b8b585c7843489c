"""Benchmark minfer on a GPU: each kernel against its vendor baseline, and end-to-end generation.

Examples:
  python apps/benchmark.py                                   # kernels, e2e and macko-e2e, float16
  python apps/benchmark.py --suite kernels --ops gemv,argmax --json out/kernels.json --plot out/kernels.png
  python apps/benchmark.py --suite kernels --ops gemv --shapes 4096x11008,32000x4096 --reps 50
  python apps/benchmark.py --suite e2e --model llama2-7b --prompt-tokens 512 --new-tokens 256
  python apps/benchmark.py --suite macko-e2e --densities 1.0,0.5,0.1 --plot out/macko.png
  python apps/benchmark.py --suite macko --densities 0.3,0.5 --shapes 12288x4096 --json out/macko.json
  python apps/benchmark.py --suite attention --lengths 8192,16384 --json out/attn.json --plot out/attn.png
  python apps/benchmark.py --suite ksmm --reps 5 --new-tokens 64 --json out/ksmm.json --plot out/ksmm.png

Kernels run back to back inside a CUDA graph over input copies rotated past L2 (median of replays);
bandwidth is reported against the device-to-device copy rate measured in the same run. The e2e
suite times a random-weight model at batch 1 with minfer's kernels and with the plain-torch backend;
the macko-e2e suite prunes it by magnitude to each density, stores it as MACKO, and reports decode
speed and peak memory against dense (beside other suites its plot goes next to --plot, suffixed
-macko-e2e). The macko suite is the MACKO kernel study of minfer.bench.macko_suite without its
launch sweep. The attention suite times block-sparse prefill against SDPA and FlexAttention (same
BlockMask) per length and layout, and fits time against the kept-block fraction (--plot draws it).
The ksmm suite times the KS factor kernel over a grid of patterns and batch sizes against dense, einsum
and bmm formulations (minfer.bench.ksmm_suite), then the model dense and with monarch-50 KS chains.

Exit status: 0 done, 2 bad input (one `error:` line on stderr), 141 when the reader of the output
went away (e.g. `| head`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Run from a checkout, no install. The repo root replaces apps/ (sys.path[0]), whose profile.py would
# shadow the standard-library module that torch.compile imports (the attention suite's FlexAttention).
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

from minfer import ops  # noqa: E402
from minfer.cli import ArgumentParser, run_main  # noqa: E402
from minfer.bench import attention_suite, e2e_suite, kernel_suite, ksmm_suite, macko_suite, report  # noqa: E402
from minfer.bench.arg_types import csv_list, density_list, matrix_shape_list, positive_int  # noqa: E402
from minfer.bench.timing import copy_bandwidth_gbs  # noqa: E402
from minfer.checkpoint import resolve  # noqa: E402
from minfer.errors import DeviceError, MinferError  # noqa: E402
from minfer.model import EMBEDDING_PLACES  # noqa: E402

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# Flags that apply to some suites only default to None (see FLAG_SUITES), then to these.
DEFAULTS = {"reps": 20, "model": "llama2-7b", "prompt_tokens": 512, "new_tokens": 256, "embedding": "host"}
E2E_SUITES = ("e2e", "macko-e2e", "ksmm", "all")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="apps/benchmark.py", description=__doc__)
    parser.add_argument("--suite", choices=("kernels", "e2e", "macko", "macko-e2e", "attention", "ksmm", "all"),
                        default="all",
                        help="all = kernels, e2e and macko-e2e; macko = the MACKO kernel study: SpMV against "
                             "cuBLAS, torch CSR, the dense reference and the reference kernel's schedule, then SpMM "
                             "and decompression (also `python -m minfer.bench.macko_suite`, with its launch sweep)")
    parser.add_argument("--ops", type=csv_list, default=None, metavar="A,B",
                        help=f"kernel ops to run (default: all of {', '.join(kernel_suite.registered_ops())})")
    parser.add_argument("--shapes", type=csv_list, default=None, metavar="NxK,...",
                        help="only the kernel cases with these shape labels (e.g. 4096x11008); macko: the matrix "
                             "shapes (default: Llama-2-7B's five)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float16")
    parser.add_argument("--reps", type=positive_int, default=None,
                        help=f"kernels, macko: timed graph replays per case (median; default {DEFAULTS['reps']}); "
                             f"the e2e suites take the median of {e2e_suite.TIMED_RUNS} generations")
    parser.add_argument("--model", default=None,
                        help=f"e2e suites: the architecture run with random weights: an alias, a local checkpoint "
                             f"folder or a Hugging Face id (default {DEFAULTS['model']})")
    parser.add_argument("--prompt-tokens", type=positive_int, default=None,
                        help=f"e2e suites: prompt length (default {DEFAULTS['prompt_tokens']})")
    parser.add_argument("--new-tokens", type=positive_int, default=None,
                        help=f"e2e suites: decoded tokens (default {DEFAULTS['new_tokens']})")
    parser.add_argument("--densities", type=density_list, default=None, metavar="D,...",
                        help="macko-e2e: densities, 1.0 meaning dense (default: "
                             f"{','.join(str(d) for d in macko_suite.E2E_DENSITIES)}); macko: the pruning "
                             f"densities (default: {','.join(str(d) for d in macko_suite.DENSITIES)})")
    parser.add_argument("--embedding", choices=EMBEDDING_PLACES, default=None,
                        help="e2e suites: where minfer keeps the token embedding (default host: pinned memory, one "
                             "row read per decode step over PCIe, 262 MB less GPU memory for llama2-7b)")
    parser.add_argument("--lengths", type=csv_list, default=None, metavar="S,...",
                        help="attention: sequence lengths (default: "
                             f"{','.join(str(n) for n in attention_suite.LENGTHS)})")
    parser.add_argument("--json", metavar="PATH", help="write the environment and every row as JSON")
    parser.add_argument("--plot", metavar="PATH",
                        help="write a PNG of speedups and bandwidth (kernels, e2e and macko-e2e suites)")
    return parser


# The suites each optional flag applies to; given with any other suite it would be ignored.
FLAG_SUITES = {"ops": ("kernels", "all"), "shapes": ("kernels", "macko", "all"),
               "densities": ("macko", "macko-e2e", "all"),
               "plot": ("kernels", "e2e", "macko-e2e", "attention", "ksmm", "all"),
               "lengths": ("attention",),
               "reps": ("kernels", "macko", "ksmm", "all"), "model": E2E_SUITES, "prompt_tokens": E2E_SUITES,
               "new_tokens": E2E_SUITES, "embedding": E2E_SUITES}


def check_e2e_model(args: argparse.Namespace) -> None:
    """The e2e suites' model and context, checked before any suite runs (they run last)."""
    try:
        config = resolve(args.model, "random").config
    except MinferError as exc:
        raise MinferError(f"--model: {exc}") from None
    context = args.prompt_tokens + args.new_tokens
    if context > config.max_position_embeddings:
        raise MinferError(f"--prompt-tokens {args.prompt_tokens} + --new-tokens {args.new_tokens} = {context} exceeds "
                          f"the {config.max_position_embeddings} positions {args.model} supports")


def check_output_path(flag: str, path: str) -> str:
    """`path` with ~ expanded. A missing folder is made now; one that cannot be written fails now, not
    after the run."""
    path = os.path.expanduser(path)
    folder = Path(path).resolve().parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MinferError(f"{flag} {path}: cannot create {folder} ({exc.strerror})") from None
    if Path(path).is_dir() or not os.access(folder, os.W_OK):
        raise MinferError(f"{flag} {path}: not a writable file path")
    return path


def run(args: argparse.Namespace) -> int:
    for name, suites in FLAG_SUITES.items():
        if getattr(args, name) is not None and args.suite not in suites:
            raise MinferError(f"--{name.replace('_', '-')} does not apply to --suite {args.suite}; it is for "
                              f"--suite {', '.join(suites)}")
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.json:
        args.json = check_output_path("--json", args.json)
    if args.plot:
        args.plot = check_output_path("--plot", args.plot)
    if args.suite in E2E_SUITES:
        check_e2e_model(args)
    macko_shapes = macko_suite.LLAMA2_7B_SHAPES
    if args.suite == "macko" and args.shapes:
        try:
            macko_shapes = matrix_shape_list(",".join(args.shapes))
        except argparse.ArgumentTypeError as e:
            raise MinferError(f"--shapes: {e}") from None
    lengths = attention_suite.LENGTHS
    if args.lengths:
        if not all(n.isdigit() and int(n) >= 1 for n in args.lengths):
            raise MinferError(f"--lengths: whole numbers >= 1, got {','.join(args.lengths)}")
        lengths = tuple(int(n) for n in args.lengths)
    if not torch.cuda.is_available():
        raise DeviceError("the benchmark needs a CUDA GPU and none is visible; run it on a GPU machine")
    ops.build()
    dtype = DTYPES[args.dtype]
    env = report.environment()
    report.print_environment(env)
    kernel_rows: list[dict] = []
    e2e_rows: list[dict] = []
    macko_rows: list[dict] = []
    macko_kernel_rows: dict[str, list[dict]] = {}
    attention_rows: list[dict] = []
    attention_fit: dict = {}
    ksmm_rows: dict[str, list[dict]] = {}

    def write_json() -> None:  # after every suite, so a run cut short keeps what it measured
        if args.json:
            report.write_json(args.json, env, {"kernels": kernel_rows, "e2e": e2e_rows, "macko_e2e": macko_rows,
                                               "macko": macko_kernel_rows, "attention": attention_rows,
                                               "attention_fit": attention_fit, "ksmm": ksmm_rows})

    if args.suite in ("kernels", "all"):
        copy_gbs, kernel_rows = kernel_suite.run(
            args.ops, args.shapes, dtype, args.reps,
            on_row=lambda row: print(f"  {row['op']} {row['shape']}: {row['minfer_ms']:.4f} ms", flush=True))
        env["copy_gbs"] = round(copy_gbs, 1)
        write_json()
    if args.suite in ("e2e", "all"):
        env.setdefault("copy_gbs", round(copy_bandwidth_gbs(), 1))
        e2e_rows = e2e_suite.run(args.model, args.prompt_tokens, args.new_tokens, dtype, env["copy_gbs"],
                                 embedding=args.embedding)
        write_json()

    if args.suite == "macko":
        densities = args.densities or macko_suite.DENSITIES
        for note in macko_suite.skipped_sections(macko_suite.STUDY_SECTIONS, densities):
            print(f"note: {note}")
        copy_gbs, macko_kernel_rows = macko_suite.run(
            macko_suite.STUDY_SECTIONS, macko_shapes, densities, dtype, args.reps,
            on_row=lambda section, row: print(f"  macko {section} {row['shape']} d{row['density']}: "
                                              f"{row['minfer_ms']:.4f} ms", flush=True))
        env["copy_gbs"] = round(copy_gbs, 1)
        write_json()
    if args.suite == "attention":
        ceilings, attention_rows, attention_fit = attention_suite.run(
            lengths, dtype, on_row=lambda row: print(f"  attention {row['layout']} {row['seq_len']}: "
                                                     f"{row['minfer_ms']:.3f} ms", flush=True))
        env.update({key: round(value, 1) for key, value in ceilings.items()})
        write_json()
    if args.suite == "ksmm":  # end to end first: its rows are the ones a cut-short run must keep
        ksmm_rows["e2e"] = ksmm_suite.e2e_rows(
            args.model, args.prompt_tokens, args.new_tokens, dtype, embedding=args.embedding,
            on_row=lambda row: print(f"  ksmm e2e {row['format']}: {row['decode_tok_s']:.1f} tok/s, prefill "
                                     f"{row['prefill_ms']:.1f} ms", flush=True))
        write_json()
        copy_gbs, ksmm_rows["grid"], ksmm_rows["summary"] = ksmm_suite.run(
            dtype, args.reps, on_row=lambda row: print(
                f"  ksmm {row['pattern']} B={row['tokens']} {row['path']}: {row['minfer_ms'] * 1e3:.1f} us, best torch "
                f"{row['speedup'] * row['minfer_ms'] * 1e3:.1f} us ({row['best']}), {row['speedup']:.2f}x"
                + (f", {row['pct_copy']:.0f}% copy" if row["pct_copy"] is not None else ""), flush=True))
        env["copy_gbs"] = round(copy_gbs, 1)
        write_json()
    if args.suite in ("macko-e2e", "all"):
        env.setdefault("copy_gbs", round(copy_bandwidth_gbs(), 1))
        densities = args.densities or macko_suite.E2E_DENSITIES
        if 1.0 not in densities:
            print("note: no density 1.0 among --densities, so no dense row and no 'vs dense' column")
        macko_rows = macko_suite.e2e_rows(
            args.model, densities, args.prompt_tokens, args.new_tokens, dtype, env["copy_gbs"],
            on_row=lambda _, row: print(f"  macko e2e d={row['density']}: {row['decode_tok_s']:.1f} tok/s", flush=True),
            embedding=args.embedding)
    print(f"device copy bandwidth: {env['copy_gbs']:.0f} GB/s (read + write)")
    if attention_rows:
        attention_suite.print_report(env, attention_rows, attention_fit, args.dtype)
    if kernel_rows:
        report.print_table(f"kernels ({env.get('device')}, {args.dtype})", kernel_suite.COLUMNS, kernel_rows)
    if e2e_rows:
        report.print_table(f"end to end: {args.model}, random weights, batch 1, {args.prompt_tokens}-token prompt, "
                           f"{args.new_tokens} new tokens, minfer's embedding on the {args.embedding}",
                           e2e_suite.COLUMNS, e2e_rows)
    for section, rows in macko_kernel_rows.items():
        report.print_table(f"MACKO {section} ({env.get('device')}, {args.dtype})", macko_suite.COLUMNS[section], rows)
    for section in ("grid", "summary", "e2e"):  # the summary and the end-to-end rows last, under the long grid
        if section not in ksmm_rows:
            continue
        rows = ksmm_rows[section]
        report.print_table(f"KS factors: {section} ({env.get('device')}, {args.dtype})", ksmm_suite.COLUMNS[section],
                           rows)
    if macko_rows:
        report.print_table(f"MACKO end to end: {args.model}, random weights pruned by magnitude, batch 1, "
                           f"embedding on the {args.embedding}", macko_suite.COLUMNS["e2e"], macko_rows)
    if args.json:
        write_json()
        print(f"wrote {args.json}")
    if args.plot and (kernel_rows or e2e_rows):
        report.plot(args.plot, env, kernel_rows, e2e_rows)
        print(f"wrote {args.plot}")
    if args.plot and attention_fit:
        attention_suite.plot_fraction(args.plot, attention_fit, f"block-sparse prefill at {attention_fit['seq_len']}, "
                                                                f"{env.get('device')}")
        print(f"wrote {args.plot}")
    if args.plot and ksmm_rows.get("grid"):
        ksmm_suite.plot(args.plot, ksmm_rows["grid"], f"KS factors, {env.get('device')}, {args.dtype}")
        print(f"wrote {args.plot}")
    if args.plot and macko_rows:
        path = Path(args.plot)
        if kernel_rows or e2e_rows:  # that plot took the path itself
            path = path.with_name(f"{path.stem}-macko-e2e{path.suffix or '.png'}")
        macko_suite.plot_e2e(str(path), macko_rows, f"{args.model}, random weights pruned by magnitude, batch 1, "
                                                    f"{env.get('device')}")
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except MinferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    run_main(main)
