"""Measure a model's perplexity on a text with minfer: what pruning costs.

The text is cut into non-overlapping windows of --seq-len tokens, each BOS followed by the next
seq_len - 1 tokens of the text, every one of them predicted once from its own window (a last piece
shorter than a window is left out); perplexity = exp(mean cross-entropy). It runs through minfer's
prefill path: the CUDA kernels on a GPU, the PyTorch references on the CPU. With no --text it reads
the children's stories shipped with minfer, which suit the embedded default model, stories260K.
The table goes to stdout (or one JSON object with --json); notes and progress bars go to stderr.

Examples:
  python apps/evaluate.py
  python apps/evaluate.py --sparse macko --density 0.5 --compare-dense
  python apps/evaluate.py --sparse macko --density 0.7 --prune wanda --compare-dense --json
  python apps/evaluate.py --model tinyllama-1.1b --text my-text.txt --seq-len 1024
  python apps/evaluate.py --model ./l7-macko
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, no install

from minfer.checkpoint import resolve  # noqa: E402
from minfer.cli import ArgumentParser, add_model_arguments, note, run_app, run_main  # noqa: E402
from minfer.errors import MinferError  # noqa: E402
from minfer.perplexity import DEFAULT_SEQ_LEN, DEFAULT_TEXT, perplexity, text_windows  # noqa: E402
from minfer.runtime import check_memory, pick_device, pick_dtype  # noqa: E402
from minfer.sparsity import cli as sparsity_cli  # noqa: E402
from minfer.sparsity.report import report_summary  # noqa: E402
from minfer.tokenizer import Tokenizer, read_text_file  # noqa: E402


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="apps/evaluate.py", description=__doc__)
    add_model_arguments(parser)
    sparsity_cli.add_arguments(parser)
    evaluation = parser.add_argument_group("evaluation")
    evaluation.add_argument("--text", default=None, metavar="FILE",
                            help=f"UTF-8 text to measure on (default: minfer's {DEFAULT_TEXT.name}, a few thousand "
                                 "words of children's stories)")
    evaluation.add_argument("--seq-len", type=int, default=None, metavar="N",
                            help=f"tokens per window, BOS included (default: {DEFAULT_SEQ_LEN}, or the model's "
                                 "limit when smaller)")
    evaluation.add_argument("--compare-dense", action="store_true",
                            help="measure the dense model too, before pruning and converting it, and show both "
                                 "with the memory their weights take")
    evaluation.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def weights_label(args: argparse.Namespace, model) -> str:
    """What the measured weights are, e.g. "dense" or "macko d=0.5 wanda"."""
    label = sparsity_cli.weight_formats(model)
    if args.density is not None:
        label += f" d={args.density} {args.prune or 'magnitude'}"
    return label


def run(args: argparse.Namespace) -> int:
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    resolved = resolve(args.model, sparsity_cli.weights_source(args), args.tokenizer)
    sparsity_cli.check(args, resolved)
    stored = sparsity_cli.compressed_source(args, resolved) is not None
    changes_weights = args.density is not None or sparsity_cli.sparse_format(args) not in ("none", "dense")
    if args.compare_dense and stored:
        raise MinferError("--compare-dense measures the dense weights first, but this model is stored compressed; "
                          "start from the dense checkpoint")
    if args.compare_dense and not changes_weights:
        raise MinferError("--compare-dense compares the dense model with a pruned or sparse one: add --sparse macko "
                          "--density D (e.g. 0.5)")
    config = resolved.config
    limit = config.max_position_embeddings
    seq_len = min(DEFAULT_SEQ_LEN, limit) if args.seq_len is None else args.seq_len
    if seq_len > limit:
        raise MinferError(f"--seq-len {seq_len} exceeds the {limit} positions this model supports")
    tokenizer = Tokenizer(resolved.tokenizer_path)
    text_path = Path(args.text) if args.text is not None else DEFAULT_TEXT
    ids = tokenizer.encode(read_text_file(text_path, "--text"), bos=False)
    windows = text_windows(ids, seq_len, tokenizer.bos_id, config.vocab_size)
    calibration_ids = sparsity_cli.calibration(args, tokenizer, config)
    check_memory(config, dtype, device, seq_len, sparsity_cli.stored_weight_bytes(args, resolved, dtype))

    dtype_name = str(dtype).removeprefix("torch.")
    note(f"minfer: {resolved.name} ({config.param_count() / 1e6:.1f}M parameters, {dtype_name}) on {device}, "
         f"{'random' if resolved.is_random else 'checkpoint'} weights: perplexity on {text_path.name}, "
         f"{len(windows)} windows of {seq_len} tokens ({len(windows) * (seq_len - 1)} scored)")
    if resolved.is_random:
        note("NOTE: RANDOM weights: their perplexity says nothing about a trained model")
    model = sparsity_cli.load_model(resolved, dtype, device, args)
    results = []
    if args.compare_dense:
        results.append(("dense", perplexity(model, windows, progress=True, label="dense"), model.weight_bytes(), None))
    sparsity = sparsity_cli.apply(model, args, calibration_ids, resolved.tokenizer_path, note, resolved.is_random)
    label = weights_label(args, model)
    results.append((label, perplexity(model, windows, progress=True, label=label), model.weight_bytes(),
                    None if sparsity is None else report_summary(sparsity)))

    if args.json:
        print(json.dumps({"model": resolved.name, "random_weights": resolved.is_random, "device": str(device),
                          "dtype": dtype_name, "text": str(text_path), "seq_len": seq_len, "windows": len(windows),
                          "tokens": len(windows) * (seq_len - 1),
                          "results": [{"weights": name, "perplexity": result.perplexity, "mean_nll": result.mean_nll,
                                       "weight_bytes": weight_bytes, "sparsity": summary}
                                      for name, result, weight_bytes, summary in results]}))
        return 0
    width = max(len("weights"), *(len(name) for name, *_ in results))
    print(f"{'weights':<{width}}  {'perplexity':>10}  {'weight MB':>9}")
    for name, result, weight_bytes, _ in results:
        print(f"{name:<{width}}  {result.perplexity:>10.3f}  {weight_bytes / 1e6:>9.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_app(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    run_main(main)
