"""The sparsity flags of apps/generate.py: prune, compress, report, save, and load compressed models."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from torch import nn

from ..checkpoint import load_model as load_checkpoint
from ..errors import MinferError
from ..formats import FORMATS, DenseWeight, WeightFormat, convert, format_class
from ..model import Transformer
from ..parallel import SINGLE, Sharding
from .compressed import check_save_target, is_compressed, save_compressed
from .compressed import stored_weight_bytes as file_weight_bytes
from .conversion import CONVERSIONS, conversion_for
from .prune import METHODS, calibration_tokens, check_density, keep_per_row, prune_model_
from .reference import load_reference, reference_formats
from .report import BlockReport, block_reports, format_report, report_summary

CALIB_SAMPLES = 16
CALIB_SEQ_LEN = 256


def sparse_flag() -> str:
    """The --sparse values that store the projections sparse, as a flag to suggest ("--sparse a|b")."""
    return "--sparse " + "|".join(sorted(name for name, cls in FORMATS.items() if cls is not DenseWeight))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(f"sparsity (with {sparse_flag()})")
    group.add_argument("--density", type=float, default=None, metavar="D",
                       help="prune each projection row to this fraction of its weights before converting "
                            "(e.g. 0.5); default: keep the checkpoint's zeros as they are (random weights "
                            "have none: they need --density)")
    group.add_argument("--prune", choices=METHODS, default=None,
                       help="how --density (or a structured --sparse such as 2:4) prunes: |w| (magnitude, the "
                            "default) or |w| * ||x|| over calibration text (wanda)")
    group.add_argument("--calib-text", default=None, metavar="FILE",
                       help="wanda calibration text (default: the small corpus shipped in minfer/data/corpus)")
    group.add_argument("--calib-samples", type=int, default=None, metavar="N",
                       help=f"wanda samples (default: {CALIB_SAMPLES})")
    group.add_argument("--calib-seq-len", type=int, default=None, metavar="L",
                       help=f"tokens per wanda sample (default: {CALIB_SEQ_LEN})")
    group.add_argument("--save-compressed", default=None, metavar="DIR",
                       help=f"write the pruned, converted model to DIR (with {sparse_flag()}; float tensors as "
                            "float16 or bfloat16 when that holds them exactly, e.g. after a float32 CPU run of a "
                            "16-bit checkpoint); later runs load it with --model DIR")
    for conversion in CONVERSIONS:
        conversion.add_arguments(group)
    for cls in reference_formats():
        group.add_argument(f"--{cls.name}-reference", dest=f"{cls.name}_reference", default=None, metavar="FILE",
                           help=f"load the projections from {cls.reference}")


class Reference(NamedTuple):
    flag: str  # --<format>-reference
    fmt: type[WeightFormat]
    file: str


def reference_source(args: argparse.Namespace) -> Reference | None:
    """The --<format>-reference flag given (another tool's checkpoint brings the projections), or None."""
    given = [Reference(f"--{cls.name}-reference", cls, getattr(args, f"{cls.name}_reference"))
             for cls in reference_formats() if getattr(args, f"{cls.name}_reference") is not None]
    if len(given) > 1:
        raise MinferError(f"{given[0].flag} and {given[1].flag} both load the projections; pass one of them")
    return given[0] if given else None


def sparse_format(args: argparse.Namespace) -> str:
    """--sparse, or "none" (dense) when not given: a compressed model then loads as stored."""
    return args.sparse or "none"


def structure(args: argparse.Namespace) -> tuple[int, int] | None:
    """The N:M structure the --sparse format needs (the CLI prunes dense projections to it), or None."""
    return format_class(sparse_format(args)).structure


def weight_formats(model: nn.Module) -> str:
    """The formats the projections are stored in, e.g. "dense" or "dense+<sparse format>"."""
    return "+".join(sorted({linear.fmt.name for _, linear in model.projections()}))


def calibration_shape(args: argparse.Namespace) -> tuple[int, int]:
    """Wanda's calibration samples and tokens per sample: the flags, or their defaults."""
    return (CALIB_SAMPLES if args.calib_samples is None else args.calib_samples,
            CALIB_SEQ_LEN if args.calib_seq_len is None else args.calib_seq_len)


def weights_source(args: argparse.Namespace) -> str:
    """resolve()'s `weights` argument: a reference checkpoint brings the weights itself."""
    reference = reference_source(args)
    if reference is None or not reference.file:
        return args.weights
    if args.weights == "random":
        raise MinferError(f"{reference.flag} loads the weights from its file: drop --weights random")
    return "none"


def compressed_source(args: argparse.Namespace, resolved) -> str | Path | None:
    """Where compressed weights load from (--<format>-reference, or a --model folder written by
    --save-compressed), or None when the weights are dense."""
    reference = reference_source(args)
    if reference is not None and reference.file:
        return reference.file
    if resolved.path is not None and is_compressed(resolved.path):
        return resolved.path
    return None


def check(args: argparse.Namespace, resolved) -> None:
    """Refuse, before loading anything, flags that would be ignored or do something else than asked."""
    reference = reference_source(args)
    reference_flag = [(reference.flag, reference.file)] if reference is not None else []
    calib_flags = [flag for flag, value in (("--calib-text", args.calib_text), ("--calib-samples", args.calib_samples),
                                            ("--calib-seq-len", args.calib_seq_len)) if value is not None]
    pattern = structure(args)
    if pattern is not None and args.density is not None:
        raise MinferError(f"--sparse {args.sparse} prunes to {pattern[0]} of every {pattern[1]} weights; "
                          "drop --density")
    if args.density is None and pattern is None and (args.prune or calib_flags):
        raise MinferError(f"{(['--prune'] if args.prune else calib_flags)[0]} sets how --density prunes; "
                          "pass --density D too (e.g. --density 0.5)")
    if args.density is not None:
        check_density(args.density)
    if calib_flags and args.prune != "wanda":
        raise MinferError(f"{calib_flags[0]} sets wanda's calibration; add --prune wanda")
    for flag, value in (("--calib-samples", args.calib_samples), ("--calib-seq-len", args.calib_seq_len)):
        if value is not None and value < 1:
            raise MinferError(f"{flag} must be at least 1, got {value}")
    for flag, value in (*reference_flag, ("--calib-text", args.calib_text),
                        ("--save-compressed", args.save_compressed)):
        if value is not None and not value.strip():
            raise MinferError(f"{flag} is empty; pass a path")
    for flag, value in (*reference_flag, ("--calib-text", args.calib_text)):
        if value and not Path(value).is_file():
            what = "is a folder, not a file" if Path(value).is_dir() else "does not exist"
            raise MinferError(f"{flag} {value} {what}")
    stored = compressed_source(args, resolved) is not None
    if args.density is not None and stored:
        raise MinferError("this model is stored compressed, so it is pruned already; --density needs dense "
                          "weights: start from the dense checkpoint")
    if args.sparse is not None and format_class(args.sparse) is DenseWeight and stored:
        raise MinferError(f"this model is stored compressed and loads with its projections as stored; --sparse "
                          f"{args.sparse} would not decompress them: drop --sparse, or start from the dense checkpoint")
    sparse = sparse_format(args)
    for conversion in CONVERSIONS:
        conversion.check(args, format_class(sparse) is conversion.format, stored, resolved.config)
    if args.density is None and resolved.is_random and format_class(sparse) is not DenseWeight \
            and conversion_for(format_class(sparse)) is None and pattern is None and not stored:
        raise MinferError(f"random weights have no zeros: --sparse {sparse} alone would store every weight "
                          "(larger than dense); pass --density D to prune them first, e.g. --density 0.5")
    _, seq_len = calibration_shape(args)
    if args.prune == "wanda" and seq_len > resolved.config.max_position_embeddings:
        given = "" if args.calib_seq_len is not None else " (the default)"
        raise MinferError(f"--calib-seq-len {seq_len}{given} exceeds the {resolved.config.max_position_embeddings} "
                          "positions this model supports; pass a smaller --calib-seq-len")
    if args.save_compressed:
        if format_class(sparse) is DenseWeight and not stored:
            raise MinferError(f"--save-compressed writes compressed projections; add {sparse_flag()} (and --density "
                              "D to prune first, e.g. --density 0.5)")
        target = Path(os.path.expanduser(args.save_compressed))
        sources = [Path(reference.file).parent] if reference is not None and reference.file else []
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
    if args.density is None and structure(args) is None:
        return None
    if args.density is not None:
        keep_per_row(min(config.hidden_size, config.num_heads * config.head_dim, config.intermediate_size),
                     args.density)
    if args.prune != "wanda":
        return None
    return calibration_tokens(tokenizer, *calibration_shape(args), args.calib_text)


def stored_weight_bytes(args: argparse.Namespace, resolved, dtype: torch.dtype) -> int | None:
    """The loaded weights' bytes when they are compressed (for the memory check), else None: dense."""
    source = compressed_source(args, resolved)
    return None if source is None else file_weight_bytes(source, dtype)


def load_model(resolved, dtype: torch.dtype, device: torch.device, args: argparse.Namespace,
               seed: int = 0, sharding: Sharding = SINGLE) -> nn.Module:
    """The model `resolved` names (compressed folders included), or one filled from --<format>-reference,
    with progress bars; with a tensor-parallel `sharding`, this rank's part of it."""
    reference = reference_source(args)
    if reference is not None and reference.file:
        return load_reference(Transformer(resolved.config), reference.fmt, Path(reference.file), dtype, device,
                              progress=True)
    return load_checkpoint(resolved, dtype, device, seed=seed, progress=True, sharding=sharding)


def check_tensor_parallel(args: argparse.Namespace) -> None:
    """Refuse the flags a tensor-parallel run does not take: each rank compresses only its own slices."""
    reference = reference_source(args)
    for flag, given in ((reference.flag if reference else "", reference is not None and reference.file),
                        ("--save-compressed", args.save_compressed), ("--prune wanda", args.prune == "wanda")):
        if given:
            raise MinferError(f"{flag} runs on one GPU; drop it or --tp (tensor-parallel ranks prune by magnitude "
                              "and compress their own slices)")


def apply(model: nn.Module, args: argparse.Namespace, calibration_ids: torch.Tensor | None,
          tokenizer_path: Path | None, note: Callable[[str], None],
          random_weights: bool = False, seed: int = 0) -> list[BlockReport] | None:
    """Prune (--density, --prune; wanda over `calibration_ids`, from calibration()), convert to
    --sparse (through the format's registered Conversion when it has one, given `random_weights` and `seed`),
    report, and save
    (--save-compressed; a save of `random_weights` says so in its file).
    Returns the per-block report when the projections are pruned or stored sparse."""
    cls = format_class(sparse_format(args))
    if cls.structure is not None and any(isinstance(linear.fmt, DenseWeight) for _, linear in model.projections()):
        method = args.prune or "magnitude"
        note(f"pruning the projections to {cls.structure[0]}:{cls.structure[1]} ({method})")
        prune_model_(model, None, method, calibration_ids, structure=cls.structure)
    if args.density is not None:
        method = args.prune or "magnitude"
        note(f"pruning the projections to density {args.density} ({method})")
        prune_model_(model, args.density, method, calibration_ids)
        if cls is DenseWeight:
            note(f"NOTE: without {sparse_flag()} the pruned projections stay dense: the same memory and speed as "
                 f"before; add {sparse_flag()} to store them compressed")
    # a dense --sparse (the default) never decompresses a model loaded in a sparse format
    converted = cls is not DenseWeight and any(not isinstance(linear.fmt, cls) for _, linear in model.projections())
    conversion = conversion_for(cls)
    if converted and conversion is not None:
        conversion.convert(model, args, random_weights, seed, note)
    elif converted:
        convert(model, sparse_format(args), progress=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the dense matrices' memory back
    reports = None
    if args.density is not None or converted or any(linear.fmt.name != DenseWeight.name
                                                    for _, linear in model.projections()):
        reports = block_reports(model)
        note(format_report(reports, model))
        summary = report_summary(reports)
        if summary["projection_bytes_stored"] > summary["projection_bytes_dense"]:
            note(f"NOTE: the projections take more memory as {weight_formats(model)} than dense; keep them dense, or "
                 "prune the dense checkpoint further (--density, e.g. 0.5)")
    if args.save_compressed:
        folder = save_compressed(model, args.save_compressed, tokenizer_path, progress=True,
                                 random_weights=random_weights)
        note(f"saved the compressed model to {folder}; run it with --model {folder}")
    return reports
