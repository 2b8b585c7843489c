"""The sparsity flags of apps/generate.py: prune, compress, report, save, and load compressed models."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..errors import MinferError
from .prune import METHODS, calibration_tokens, prune_model_
from .report import block_reports, format_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sparsity (with --sparse macko)")
    group.add_argument("--density", type=float, default=None, metavar="D",
                       help="prune each projection row to this fraction of its weights before converting "
                            "(e.g. 0.5); default: keep the checkpoint's zeros as they are")
    group.add_argument("--prune", choices=METHODS, default="magnitude",
                       help="pruning score: |w| (magnitude) or |w| * ||x|| over calibration text (wanda)")
    group.add_argument("--calib-text", default=None, metavar="FILE",
                       help="wanda calibration text (default: the small corpus shipped in data/corpus)")
    group.add_argument("--calib-samples", type=int, default=16, metavar="N", help="wanda samples (default: 16)")
    group.add_argument("--calib-seq-len", type=int, default=256, metavar="L",
                       help="tokens per wanda sample (default: 256)")
    group.add_argument("--save-compressed", default=None, metavar="DIR",
                       help="write the pruned, converted model to DIR; later runs load it with --model DIR")
    group.add_argument("--macko-reference", default=None, metavar="FILE",
                       help="load the projections from a checkpoint of macko_spmv's compression script "
                            "(keys <name>.c_0 ... c_4); config and tokenizer come from --model")


def load_model(resolved, dtype: torch.dtype, device: torch.device, args: argparse.Namespace,
               seed: int = 0) -> nn.Module:
    """The model `resolved` names (compressed folders included), or one filled from --macko-reference."""
    from ..checkpoint import load_model as load_checkpoint
    from ..model import Transformer
    from .compressed import load_reference_macko

    if args.macko_reference:
        path = Path(args.macko_reference)
        if not path.is_file():
            raise MinferError(f"--macko-reference {path} does not exist")
        return load_reference_macko(Transformer(resolved.config), path, dtype, device)
    return load_checkpoint(resolved, dtype, device, seed=seed)


def apply(model: nn.Module, args: argparse.Namespace, tokenizer, tokenizer_path: Path | None,
          note: Callable[[str], None]) -> None:
    """Prune (--density, --prune), convert to --sparse, report, and save (--save-compressed)."""
    from ..formats import convert, format_class

    cls = format_class(args.sparse)
    if args.density is not None:
        calibration = None
        if args.prune == "wanda":
            calibration = calibration_tokens(tokenizer, args.calib_samples, args.calib_seq_len, args.calib_text)
        note(f"pruning the projections to density {args.density} ({args.prune})")
        prune_model_(model, args.density, args.prune, calibration)
    # a dense --sparse (the default) never decompresses a model loaded in a sparse format
    converted = cls.name != "dense" and any(not isinstance(linear.fmt, cls) for _, linear in model.projections())
    if converted:
        convert(model, args.sparse)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the dense matrices' memory back
    if args.density is not None or converted or any(linear.fmt.name != "dense" for _, linear in model.projections()):
        note(format_report(block_reports(model), model))
    if args.save_compressed:
        from .compressed import save_compressed

        folder = save_compressed(model, args.save_compressed, tokenizer_path)
        note(f"saved the compressed model to {folder}; run it with --model {folder}")
