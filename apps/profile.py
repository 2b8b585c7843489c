"""Run chosen kernels, or one decode step, a few times inside NVTX ranges between
cudaProfilerStart/Stop, so that a profiler sees exactly that region:

  ncu --set full python apps/profile.py          # a decode step of llama2-7b (random weights), layer 0
  ncu --set full --profile-from-start off python apps/profile.py --op gemv
  ncu --set full --profile-from-start off -o gemv python apps/profile.py --op gemv --shapes 4096x11008 --baseline
  nsys profile --capture-range=cudaProfilerApi python apps/profile.py --op decode --layers 0
  ncu --set full --profile-from-start off -k regex:macko_spmv python apps/profile.py --op decode --sparse macko
  python apps/profile.py --op decode --timeline [--sparse macko --density 0.5]
  python apps/profile.py --op decode --timeline --tp 2 --model llama2-70b   # rank 0's step, all-reduces included

`--timeline` needs no external profiler: it traces CUDA-graph decode steps with the torch profiler
(CUPTI) and prints what each kernel adds to a step's critical path (minfer/bench/decode_timeline.py).

Warm-up (JIT build, model setup, allocation, library init) runs before the profiled region. ncu
started from the repository root reads config.ncu-cfg there, which sets --profile-from-start off,
so the plain `ncu --set full python apps/profile.py` profiles the region only (ncu ignores
cudaProfilerStop while it profiles from the start; it would otherwise replay each of the hundreds
of kernels that fill the random weights). `--baseline` also runs each case's vendor baseline in its
own range ("baseline: ...") for a side-by-side report.

Exit status: 0 done, 2 bad input (one `error:` line on stderr), 141 when the reader of the output
went away (e.g. `| head`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, no install

import torch  # noqa: E402

from minfer.bench import decode_timeline as timeline  # noqa: E402
from minfer.cli import ArgumentParser, run_main  # noqa: E402
from minfer import ops, parallel  # noqa: E402
from minfer.bench import kernel_suite  # noqa: E402
from minfer.bench.arg_types import csv_list  # noqa: E402
from minfer.bench.e2e_suite import build_model  # noqa: E402
from minfer.bench.report import print_table  # noqa: E402
from minfer.checkpoint import resolve  # noqa: E402
from minfer.errors import DeviceError, MinferError  # noqa: E402
from minfer.formats import DenseWeight, convert, format_choices, format_class  # noqa: E402
from minfer.generate import Generator  # noqa: E402
from minfer.sparsity import prune_model_  # noqa: E402

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
DECODE = "decode"
DECODE_DENSITY = 0.5
TIMELINE_STEPS = 32


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="apps/profile.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", default=DECODE, choices=[*kernel_suite.registered_ops(), DECODE],
                        help="a kernel from the benchmark registry, or one decode step of --model (default)")
    parser.add_argument("--shapes", type=csv_list, default=None,
                        help="kernels: comma-separated shape labels (default: every case)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float16")
    parser.add_argument("--iters", type=int, default=None,
                        help="profiled runs of each case (default 3; one decode step: 1; not with --timeline)")
    parser.add_argument("--baseline", action="store_true", help="kernels: also run the vendor baseline of each case")
    parser.add_argument("--model", default="llama2-7b",
                        help="decode: the architecture profiled, with random weights: an alias (e.g. llama2-7b), "
                             "a local checkpoint folder or a Hugging Face id")
    parser.add_argument("--context", type=int, default=512, help="decode: cache positions filled before the step")
    parser.add_argument("--layers", type=int, default=None, metavar="N",
                        help="decode: profile the embedding and the first N layers of the step, which repeat the "
                             "same kernels (default 1: 7 kernels, ~30 s under ncu --set full; 0 = the whole "
                             "step: every layer, the final norm and lm_head, ~10 min)")
    parser.add_argument("--timeline", action="store_true",
                        help="decode: trace graph-replayed steps and print each kernel's share of a step")
    parser.add_argument("--tp", type=int, default=None, metavar="N",
                        help="decode --timeline: split the model over N GPUs (tensor parallelism, one process each); "
                             "rank 0's step is traced, its all-reduces included")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"decode --timeline: traced steps (default {TIMELINE_STEPS})")
    parser.add_argument("--sparse", choices=format_choices(), default="none",
                        help="decode: weight format of the projections (default none)")
    swept = ", ".join(f"{op} ({', '.join(map(str, kernel_suite.op_densities(op)))})"
                      for op in kernel_suite.registered_ops() if kernel_suite.op_densities(op))
    parser.add_argument("--density", type=float, default=None,
                        help=f"decode with a sparse --sparse: density after magnitude pruning (default "
                             f"{DECODE_DENSITY}); a kernel op swept over densities: only the cases of this one "
                             f"(ops: {swept})")
    return parser


class ProfiledRegion:
    """cudaProfilerStart/Stop around the block, with the device idle at both ends."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def profile_kernels(args: argparse.Namespace) -> None:
    cases = kernel_suite.select([args.op], args.shapes, DTYPES[args.dtype])
    if args.density is not None:  # a kernel op swept over densities (main checks)
        cases = [case for case in cases if f" d{args.density} " in case.shape]
    prepared = []
    for case in cases:
        ours, baseline = case.build(1)
        ours(0)
        if args.baseline and baseline is not None:
            baseline(0)
        prepared.append((case, ours, baseline if args.baseline else None))
    with ProfiledRegion():
        for case, ours, baseline in prepared:
            for it in range(args.iters):
                with torch.cuda.nvtx.range(f"minfer: {case.op} {case.shape} #{it}"):
                    ours(0)
                if baseline is not None:
                    with torch.cuda.nvtx.range(f"baseline: {case.baseline} {case.shape} #{it}"):
                        baseline(0)
    print(f"profiled {len(prepared)} case(s) of {args.op}, {args.iters} run(s) each")


def check_decode_context(args: argparse.Namespace) -> None:
    """--context (plus the traced steps) within --model's positions, checked before the model is built."""
    try:
        config = resolve(args.model, "random").config
    except MinferError as exc:
        raise MinferError(f"--model: {exc}") from None
    positions = args.context + (args.steps + 2 if args.timeline else 1)
    if positions > config.max_position_embeddings:
        raise MinferError(f"--context {args.context} needs {positions} cache positions, more than the "
                          f"{config.max_position_embeddings} {args.model} supports; pass a smaller --context")


def decode_model(args: argparse.Namespace, sharding: parallel.Sharding = parallel.SINGLE):
    """--model with random weights (this rank's part under tensor parallelism), its projections pruned by
    magnitude (to the format's N:M structure where it has one) and stored in a sparse --sparse format;
    returns the model and a label for the output."""
    model = build_model(args.model, DTYPES[args.dtype], sharding=sharding)
    fmt = format_class(args.sparse)
    if fmt is DenseWeight:
        return model, "dense"
    if fmt.structure is not None:
        prune_model_(model, None, "magnitude", structure=fmt.structure)
        convert(model, fmt.name, progress=True)
        return model, fmt.name
    density = DECODE_DENSITY if args.density is None else args.density
    prune_model_(model, density, "magnitude")
    convert(model, fmt.name, progress=True)
    return model, f"{fmt.name} d={density}"


@torch.inference_mode()
def profile_decode(args: argparse.Namespace) -> None:
    """One-token forward passes at position `context` (eager, so each kernel shows on its own);
    profiling stops when layer `--layers` starts (the layers repeat the same kernels)."""
    model, label = decode_model(args)
    model.setup_caches(1, args.context + 1)
    token = torch.zeros(1, 1, dtype=torch.int64, device="cuda")
    pos = torch.tensor([args.context], device="cuda")
    model(token, pos)  # warm-up
    layers = len(model.layers) if args.layers == 0 else min(args.layers or 1, len(model.layers))

    def stop_profiling(*_) -> None:  # a pre-hook that returned the cudaError_t would replace the layer's inputs
        torch.cuda.cudart().cudaProfilerStop()

    stop = model.layers[layers].register_forward_pre_hook(stop_profiling) if layers < len(model.layers) else None
    scope = "the whole step" if stop is None else f"the embedding and layers 0..{layers - 1}"
    try:
        for it in range(args.iters):
            with ProfiledRegion(), torch.cuda.nvtx.range(
                    f"minfer: decode step {args.model} {label} pos {args.context} #{it}"):
                model(token, pos)
    finally:
        if stop is not None:
            stop.remove()
    print(f"profiled {args.iters} decode step(s) of {args.model} ({label}) at position {args.context}: {scope}")


@torch.inference_mode()
def decode_timeline(args: argparse.Namespace) -> None:
    sharding = parallel.SINGLE
    if parallel.launched_world() > 1:
        sharding, _ = parallel.init("cuda")
        parallel.quiet_other_ranks(sharding)
    model, label = decode_model(args, sharding)
    if sharding.active:
        label += f", TP {sharding.world} (rank 0)"
    generator = Generator(model, None, args.context + args.steps + 2, "cuda")
    prompt = torch.randint(0, model.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    rows, step_us = timeline.run(generator, prompt.tolist(), args.steps)
    print_table(f"{args.model} {label}: decode step at ~{args.context} positions, {step_us:.1f} µs "
                f"({1e6 / step_us:.1f} tok/s), median of {args.steps} traced steps", timeline.COLUMNS, rows)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.timeline and args.op != DECODE:
        parser.error("--timeline traces decode steps: use it with --op decode")
    sparse = format_class(args.sparse) is not DenseWeight
    if sparse and args.op != DECODE:
        parser.error("--sparse sets the model's weight format: use it with --op decode")
    if args.op == DECODE and (args.baseline or args.shapes):
        parser.error("--baseline and --shapes choose kernel cases: use them with --op <kernel>, not decode")
    if args.timeline and args.iters is not None:
        parser.error("--iters counts profiled runs; --timeline traces --steps graph-replayed steps instead")
    if args.steps is not None and not args.timeline:
        parser.error("--steps counts the steps --timeline traces: use it with --timeline")
    if args.iters is None:
        args.iters = 1 if args.op == DECODE else 3
    if args.steps is None:
        args.steps = TIMELINE_STEPS
    if args.layers is not None and (args.op != DECODE or args.timeline):
        parser.error("--layers cuts the profiled decode step: use it with --op decode, without --timeline")
    if args.tp is not None and (args.tp < 1 or not args.timeline):
        parser.error("--tp N (N >= 1) splits the model of --op decode --timeline")
    if (args.tp or 1) > 1 and parallel.launched_world() == 1:  # start the ranks, each runs this
        return parallel.launch([sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:])], args.tp)
    if args.steps < 2 or args.context < 1 or args.iters < 1 or (args.layers or 0) < 0:
        parser.error("--steps must be at least 2, --context and --iters at least 1, --layers at least 0")
    if args.density is not None:
        case_densities = kernel_suite.op_densities(args.op) if args.op != DECODE else ()
        if case_densities and args.density not in case_densities:
            parser.error(f"--op {args.op} has cases at densities {', '.join(map(str, case_densities))}, "
                         f"not {args.density}")
        if not case_densities and not (args.op == DECODE and sparse):
            parser.error("--density picks the pruning of --op decode with a sparse --sparse, or the cases of a "
                         "kernel op swept over densities")
        if args.op == DECODE and format_class(args.sparse).structure is not None:
            parser.error(f"--sparse {args.sparse} prunes to its own N:M structure: drop --density")
        if not 0.0 < args.density <= 1.0:
            parser.error(f"--density must lie in (0, 1], got {args.density}")
    try:
        if args.op == DECODE:
            check_decode_context(args)
        if not torch.cuda.is_available():
            raise DeviceError("profiling needs a CUDA GPU and none is visible; run it on a GPU machine")
        ops.build()
        if args.op == DECODE:
            decode_timeline(args) if args.timeline else profile_decode(args)
        else:
            profile_kernels(args)
    except MinferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        parallel.shutdown()
    return 0


if __name__ == "__main__":
    run_main(main)
