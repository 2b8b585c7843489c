"""Benchmark minfer on a GPU: each kernel against its vendor baseline, and end-to-end generation.

Examples:
  python apps/benchmark.py                                   # kernels, e2e and macko-e2e, float16
  python apps/benchmark.py --suite kernels --ops gemv,argmax --json out/kernels.json --plot out/kernels.png
  python apps/benchmark.py --suite kernels --ops gemv --shapes 4096x11008,32000x4096 --reps 50
  python apps/benchmark.py --suite e2e --model llama2-7b --prompt-tokens 512 --new-tokens 256
  python apps/benchmark.py --suite macko-e2e --densities 1.0,0.5,0.1 --plot out/macko.png
  python apps/benchmark.py --suite macko --densities 0.3,0.5 --shapes 12288x4096 --json out/macko.json
  python apps/benchmark.py --suite sparse24 --json out/sparse24.json
  python apps/benchmark.py --suite attention --lengths 8192,16384 --json out/attn.json --plot out/attn.png
  python apps/benchmark.py --suite ksmm --reps 5 --new-tokens 64 --json out/ksmm.json --plot out/ksmm.png
  python apps/benchmark.py --suite attention --phases decode --lengths 4096,32768
  python apps/benchmark.py --suite e2e --context 32768 --attention blocksparse --layout sink-window:sink=128,window=2048
  python apps/benchmark.py --suite e2e --model llama2-70b --tp 2 --prompt-tokens 32 --new-tokens 128

Kernels run back to back inside a CUDA graph over input copies rotated past L2 (median of replays);
bandwidth is reported against the device-to-device copy rate measured in the same run. The e2e
suite times a random-weight model at batch 1 with minfer's kernels and with the plain-torch backend;
the macko-e2e suite prunes it by magnitude to each density, stores it as MACKO, and reports decode
speed and peak memory against dense (beside other suites its plot goes next to --plot, suffixed
-macko-e2e). The macko suite is the MACKO kernel study of minfer.bench.macko_suite without its
launch sweep. The attention suite times block-sparse prefill against SDPA and FlexAttention (same
BlockMask) per length and layout, and fits time against the kept-block fraction (--plot draws it), then
block-sparse decode against dense SDPA and FlexAttention decode. With --attention blocksparse the e2e
suite compares the model with dense attention and with the --layout, both on minfer's kernels.
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

from minfer import ops, parallel  # noqa: E402
from minfer.cli import ArgumentParser, run_main  # noqa: E402
from minfer.bench import attention_suite, e2e_suite, kernel_suite, macko_suite, report, suites  # noqa: E402
from minfer.bench.arg_types import csv_list, density_list, positive_int  # noqa: E402
from minfer.attention.layouts import LAYOUT_HELP, parse_layout  # noqa: E402
from minfer.checkpoint import resolve  # noqa: E402
from minfer.errors import DeviceError, MinferError  # noqa: E402
from minfer.model import EMBEDDING_PLACES  # noqa: E402
from minfer.runtime import RANDOM_WEIGHTS_MAX_SEQ_LEN  # noqa: E402

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# Flags that apply to some suites only default to None (see SUITE_FLAGS), then to these.
DEFAULTS = {"reps": 20, "model": "llama2-7b", "prompt_tokens": 512, "new_tokens": 256, "embedding": "host"}
# The flags some suites take (each suite's Suite.flags says which), in the order they are checked.
SUITE_FLAGS = ("ops", "shapes", "densities", "plot", "lengths", "phases", "context", "attention", "layout", "reps",
               "model", "prompt_tokens", "new_tokens", "embedding", "tp", "batches")


def suite_help() -> str:
    """--suite's help: what "all" runs, then each suite's own line."""
    members = [suite.name for suite in suites.chosen("all")]
    lines = [f"all = {', '.join(members[:-1])} and {members[-1]}"]
    lines += [f"{suite.name} = {suite.help}" for suite in suites.registered().values() if suite.help]
    return "; ".join(lines)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="apps/benchmark.py", description=__doc__)
    parser.add_argument("--suite", choices=(*suites.registered(), "all"), default="all", help=suite_help())
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
    parser.add_argument("--tp", type=positive_int, default=None, metavar="N",
                        help="e2e suites: split the model over N GPUs of this host (tensor parallelism, one process "
                             "each, started here or by torchrun); memory and bandwidth are then per GPU")
    parser.add_argument("--lengths", type=csv_list, default=None, metavar="S,...",
                        help="attention: sequence lengths (default: "
                             f"{','.join(str(n) for n in attention_suite.LENGTHS)})")
    parser.add_argument("--phases", type=csv_list, default=None, metavar="P,...",
                        help=f"attention: which of {','.join(attention_suite.PHASES)} to time (default: both)")
    parser.add_argument("--context", type=positive_int, default=None, metavar="N",
                        help="e2e: the context the decode reaches: the prompt is N - --new-tokens tokens (the cache "
                             "holds N positions; with random weights up to 32768 whatever the model's limit)")
    parser.add_argument("--attention", choices=("dense", "blocksparse"), default=None,
                        help="e2e: blocksparse compares the model with dense attention and with --layout, both on "
                             "minfer's kernels (default dense: minfer against the plain-torch backend)")
    parser.add_argument("--layout", default=None, metavar="NAME[:k=v,...]",
                        help=f"e2e with --attention blocksparse: the layout ({LAYOUT_HELP})")
    parser.add_argument("--batches", type=csv_list, default=None, metavar="B,...",
                        help="ksmm: the grid's batch sizes (default: 1,16,512,4096)")
    parser.add_argument("--json", metavar="PATH", help="write the environment and every row as JSON")
    parser.add_argument("--plot", metavar="PATH",
                        help="write a PNG of speedups and bandwidth (kernels, e2e and macko-e2e suites)")
    return parser


def check_e2e_model(args: argparse.Namespace) -> None:
    """The e2e suites' model, context and attention, checked before any suite runs (they run last)."""
    try:
        config = resolve(args.model, "random").config
    except MinferError as exc:
        raise MinferError(f"--model: {exc}") from None
    if (args.attention == "blocksparse") != (args.layout is not None):
        raise MinferError("--attention blocksparse and --layout go together: give both or neither")
    if args.layout is not None:
        parse_layout(args.layout)
    if args.context is not None:
        if args.context <= args.new_tokens or args.context > RANDOM_WEIGHTS_MAX_SEQ_LEN:
            raise MinferError(f"--context must exceed --new-tokens {args.new_tokens} and be at most "
                              f"{RANDOM_WEIGHTS_MAX_SEQ_LEN}, got {args.context}")
        args.prompt_tokens = args.context - args.new_tokens
        return
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


def check_suite_flags(args: argparse.Namespace) -> None:
    """Refuse a flag the chosen suite would ignore (before --tp starts any rank)."""
    for name in SUITE_FLAGS:
        applies_to = suites.flag_suites(name)
        if getattr(args, name) is not None and args.suite not in applies_to:
            raise MinferError(f"--{name.replace('_', '-')} does not apply to --suite {args.suite}; it is for "
                              f"--suite {', '.join(applies_to)}")
    if args.context is not None and args.prompt_tokens is not None:
        raise MinferError("--context sets the prompt length (context - new tokens): drop --prompt-tokens")


def run(args: argparse.Namespace) -> int:
    check_suite_flags(args)
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.json:
        args.json = check_output_path("--json", args.json)
    if args.plot:
        args.plot = check_output_path("--plot", args.plot)
    chosen = suites.chosen(args.suite)
    if any(suite.e2e for suite in chosen):
        check_e2e_model(args)
    for suite in chosen:
        if suite.check is not None:
            suite.check(args)
    if not torch.cuda.is_available():
        raise DeviceError("the benchmark needs a CUDA GPU and none is visible; run it on a GPU machine")
    sharding = parallel.SINGLE
    if parallel.launched_world() > 1:
        if args.tp not in (None, parallel.launched_world()):
            raise MinferError(f"--tp {args.tp} but the launcher started {parallel.launched_world()} processes")
        sharding, _ = parallel.init("cuda")
        parallel.quiet_other_ranks(sharding)
        if sharding.rank:  # rank 0 alone writes the files
            args.json = args.plot = None
    ops.build()
    env = report.environment()
    report.print_environment(env)
    results = {key: empty() for suite in suites.registered().values() for key, empty in suite.sections.items()}

    def write_json() -> None:  # after every suite, so a run cut short keeps what it measured
        if args.json:
            report.write_json(args.json, env, results)

    bench = suites.SuiteRun(args, DTYPES[args.dtype], env, sharding, results, write_json)
    for suite in chosen:
        bench.save(suite.run(bench))
    print(f"device copy bandwidth: {env['copy_gbs']:.0f} GB/s (read + write)")
    for suite in chosen:
        suite.report(bench)
    if args.json:
        write_json()
        print(f"wrote {args.json}")
    if args.plot:
        plot_all(bench, chosen)
    return 0


def plot_all(bench: suites.SuiteRun, chosen: list[suites.Suite]) -> None:
    """Each distinct plot of the chosen suites (suites sharing a figure give the same function): the first
    one drawn takes --plot, a later one goes beside it, suffixed with its suite's name."""
    tried = set()
    written = False
    for suite in chosen:
        if suite.plot is None or suite.plot in tried:
            continue
        tried.add(suite.plot)
        path = bench.args.plot
        if written:
            path = Path(path).with_name(f"{Path(path).stem}-{suite.name}{Path(path).suffix or '.png'}")
        if suite.plot(bench, str(path)):
            written = True
            print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        if args.tp is not None and args.tp > 1 and parallel.launched_world() == 1:  # start the ranks, each runs this
            check_suite_flags(args)
            return parallel.launch([sys.executable, str(Path(__file__).resolve()), *argv], args.tp)
        return run(args)
    except MinferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        parallel.shutdown()


if __name__ == "__main__":
    run_main(main)
