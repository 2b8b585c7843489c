"""The sparsity flags of apps/generate.py: prune, compress, report, save, and load compressed models."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..errors import MinferError
from .prune import METHODS, calibration_tokens, check_density, keep_per_row, prune_model_
from .report import BlockReport, block_reports, format_report, report_summary

CALIB_SAMPLES = 16
CALIB_SEQ_LEN = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sparsity (with --sparse macko)")
    group.add_argument("--density", type=float, default=None, metavar="D",
                       help="prune each projection row to this fraction of its weights before converting "
                            "(e.g. 0.5); default: keep the checkpoint's zeros as they are (random weights "
                            "have none: they need --density)")
    group.add_argument("--prune", choices=METHODS, default=None,
                       help="how --density prunes: |w| (magnitude, the default) or |w| * ||x|| over "
                            "calibration text (wanda)")
    group.add_argument("--calib-text", default=None, metavar="FILE",
                       help="wanda calibration text (default: the small corpus shipped in data/corpus)")
    group.add_argument("--calib-samples", type=int, default=None, metavar="N",
                       help=f"wanda samples (default: {CALIB_SAMPLES})")
    group.add_argument("--calib-seq-len", type=int, default=None, metavar="L",
                       help=f"tokens per wanda sample (default: {CALIB_SEQ_LEN})")
    group.add_argument("--save-compressed", default=None, metavar="DIR",
                       help="write the pruned, converted model to DIR (with --sparse macko; float tensors as "
                            "float16 or bfloat16 when that holds them exactly, e.g. after a float32 CPU run of a "
                            "16-bit checkpoint); later runs load it with --model DIR")
    group.add_argument("--macko-reference", default=None, metavar="FILE",
                       help="load the projections from a checkpoint of macko_spmv's compression script "
                            "(keys <name>.c_0 ... c_4); config and tokenizer come from --model, whose "
                            "weights are not downloaded")


def sparse_format(args: argparse.Namespace) -> str:
    """--sparse, or "none" (dense) when not given: a compressed model then loads as stored."""
    return args.sparse or "none"


def weight_formats(model: nn.Module) -> str:
    """The formats the projections are stored in, e.g. "macko" or "dense+macko"."""
    return "+".join(sorted({linear.fmt.name for _, linear in model.projections()}))


def calibration_shape(args: argparse.Namespace) -> tuple[int, int]:
    """Wanda's calibration samples and tokens per sample: the flags, or their defaults."""
    return (CALIB_SAMPLES if args.calib_samples is None else args.calib_samples,
            CALIB_SEQ_LEN if args.calib_seq_len is None else args.calib_seq_len)


def weights_source(args: argparse.Namespace) -> str:
    """resolve()'s `weights` argument: a reference checkpoint brings the weights itself."""
    if not args.macko_reference:
        return args.weights
    if args.weights == "random":
        raise MinferError("--macko-reference loads the weights from its file: drop --weights random")
    return "none"


def compressed_source(args: argparse.Namespace, resolved) -> str | Path | None:
    """Where compressed weights load from (--macko-reference, or a --model folder written by
    --save-compressed), or None when the weights are dense."""
    from .compressed import is_compressed

    if args.macko_reference:
        return args.macko_reference
    if resolved.path is not None and is_compressed(resolved.path):
        return resolved.path
    return None


def check(args: argparse.Namespace, resolved) -> None:
    """Refuse, before loading anything, flags that would be ignored or do something else than asked."""
    from ..formats import format_class

    calib_flags = [flag for flag, value in (("--calib-text", args.calib_text), ("--calib-samples", args.calib_samples),
                                            ("--calib-seq-len", args.calib_seq_len)) if value is not None]
    if args.density is None and (args.prune or calib_flags):
        raise MinferError(f"{(['--prune'] if args.prune else calib_flags)[0]} sets how --density prunes; "
                          "pass --density D too (e.g. --density 0.5)")
    if args.density is not None:
        check_density(args.density)
    if calib_flags and args.prune != "wanda":
        raise MinferError(f"{calib_flags[0]} sets wanda's calibration; add --prune wanda")
    for flag, value in (("--calib-samples", args.calib_samples), ("--calib-seq-len", args.calib_seq_len)):
        if value is not None and value < 1:
            raise MinferError(f"{flag} must be at least 1, got {value}")
    for flag, value in (("--macko-reference", args.macko_reference), ("--calib-text", args.calib_text),
                        ("--save-compressed", args.save_compressed)):
        if value is not None and not value.strip():
            raise MinferError(f"{flag} is empty; pass a path")
    for flag, value in (("--macko-reference", args.macko_reference), ("--calib-text", args.calib_text)):
        if value and not Path(value).is_file():
            what = "is a folder, not a file" if Path(value).is_dir() else "does not exist"
            raise MinferError(f"{flag} {value} {what}")
    stored = compressed_source(args, resolved) is not None
    if args.density is not None and stored:
        raise MinferError("this model is stored compressed, so it is pruned already; --density needs dense "
                          "weights: start from the dense checkpoint")
    if args.sparse is not None and format_class(args.sparse).name == "dense" and stored:
        raise MinferError(f"this model is stored compressed and loads with its projections as stored; --sparse "
                          f"{args.sparse} would not decompress them: drop --sparse, or start from the dense checkpoint")
    sparse = sparse_format(args)
    if args.density is None and resolved.is_random and format_class(sparse).name != "dense" and not stored:
        raise MinferError(f"random weights have no zeros: --sparse {sparse} alone would store every weight "
                          "(larger than dense); pass --density D to prune them first, e.g. --density 0.5")
    _, seq_len = calibration_shape(args)
    if args.prune == "wanda" and seq_len > resolved.config.max_position_embeddings:
        given = "" if args.calib_seq_len is not None else " (the default)"
        raise MinferError(f"--calib-seq-len {seq_len}{given} exceeds the {resolved.config.max_position_embeddings} "
                          "positions this model supports; pass a smaller --calib-seq-len")
    if args.save_compressed:
        if format_class(sparse).name == "dense" and not stored:
            raise MinferError("--save-compressed writes compressed projections; add --sparse macko (and --density D "
                              "to prune first, e.g. --density 0.5)")
        from .compressed import check_save_target

        target = Path(os.path.expanduser(args.save_compressed))
        sources = [Path(args.macko_reference).parent] if args.macko_reference else []
        sources += [resolved.path] if resolved.path is not None else []
        if args.model and Path(os.path.expanduser(args.model)).is_dir():  # with random weights too: its files stay
            sources.append(Path(os.path.expanduser(args.model)))
        if target.is_dir() and any(target.samefile(source) for source in sources):
            raise MinferError(f"--save-compressed {target} is the folder the weights are read from; "
                              "pass a new folder")
        try:
            check_save_target(target)  # now, not after loading and pruning
        except MinferError as exc:
            raise MinferError(f"--save-compressed: {exc}") from None


def calibration(args: argparse.Namespace, tokenizer, config) -> torch.Tensor | None:
    """What --density needs, checked before the weights load: every projection row keeps a weight, and
    wanda's calibration text is long enough. Returns wanda's calibration tokens (None without wanda)."""
    if args.density is None:
        return None
    keep_per_row(min(config.hidden_size, config.num_heads * config.head_dim, config.intermediate_size), args.density)
    if args.prune != "wanda":
        return None
    return calibration_tokens(tokenizer, *calibration_shape(args), args.calib_text)


def stored_weight_bytes(args: argparse.Namespace, resolved, dtype: torch.dtype) -> int | None:
    """The loaded weights' bytes when they are compressed (for the memory check), else None: dense."""
    from .compressed import stored_weight_bytes as file_weight_bytes

    source = compressed_source(args, resolved)
    return None if source is None else file_weight_bytes(source, dtype)


def load_model(resolved, dtype: torch.dtype, device: torch.device, args: argparse.Namespace,
               seed: int = 0) -> nn.Module:
    """The model `resolved` names (compressed folders included), or one filled from --macko-reference,
    with progress bars."""
    from ..checkpoint import load_model as load_checkpoint
    from ..model import Transformer
    from .compressed import load_reference_macko

    if args.macko_reference:
        return load_reference_macko(Transformer(resolved.config), Path(args.macko_reference), dtype, device,
                                    progress=True)
    return load_checkpoint(resolved, dtype, device, seed=seed, progress=True)


def apply(model: nn.Module, args: argparse.Namespace, calibration_ids: torch.Tensor | None,
          tokenizer_path: Path | None, note: Callable[[str], None],
          random_weights: bool = False) -> list[BlockReport] | None:
    """Prune (--density, --prune; wanda over `calibration_ids`, from calibration()), convert to
    --sparse, report, and save (--save-compressed; a save of `random_weights` says so in its file).
    Returns the per-block report when the projections are pruned or stored sparse."""
    from ..formats import convert, format_class

    cls = format_class(sparse_format(args))
    if args.density is not None:
        method = args.prune or "magnitude"
        note(f"pruning the projections to density {args.density} ({method})")
        prune_model_(model, args.density, method, calibration_ids)
        if cls.name == "dense":
            note("NOTE: without --sparse macko the pruned projections stay dense: the same memory and speed as "
                 "before; add --sparse macko to store them compressed")
    # a dense --sparse (the default) never decompresses a model loaded in a sparse format
    converted = cls.name != "dense" and any(not isinstance(linear.fmt, cls) for _, linear in model.projections())
    if converted:
        convert(model, sparse_format(args), progress=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the dense matrices' memory back
    reports = None
    if args.density is not None or converted or any(linear.fmt.name != "dense" for _, linear in model.projections()):
        reports = block_reports(model)
        note(format_report(reports, model))
        summary = report_summary(reports)
        if summary["projection_bytes_stored"] > summary["projection_bytes_dense"]:
            note(f"NOTE: the projections take more memory as {weight_formats(model)} than dense (MACKO pays off "
                 "below a density of about 0.75); keep them dense, or prune the dense checkpoint further "
                 "(--density, e.g. 0.5)")
    if args.save_compressed:
        from .compressed import save_compressed

        folder = save_compressed(model, args.save_compressed, tokenizer_path, progress=True,
                                 random_weights=random_weights)
        note(f"saved the compressed model to {folder}; run it with --model {folder}")
    return reports
