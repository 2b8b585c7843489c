"""Compressed checkpoints: prune and compress once, then start fast.

A compressed folder holds config.json, the tokenizer, and one model.safetensors with every tensor
under its minfer name (`layers.0.self_attn.qkv_proj.fmt.values`, ..., `embed_tokens.weight`) plus a
metadata entry `minfer_formats`: JSON mapping each projection to its format and shape. It loads like
any checkpoint folder (`--model DIR`): the projections are built in their formats on the meta
device, allocated once on the target device, and filled from the memory-mapped file.

Checkpoints written by the reference tool's compression script (macko_spmv's
`util_compress_llm.py`: HF names with `.weight` replaced by `.c_0` ... `.c_4` = values, deltas,
row_ptr, rows, cols) load with `load_reference_macko`. That script writes them with `torch.save`;
they are read with `torch.load(weights_only=True)`, which refuses anything but tensors and plain
containers. A safetensors file with the same keys works too.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import CheckpointError, FormatError
from ..formats import FORMATS, DenseWeight, MackoWeight
from ..formats.macko import concat_rows
from ..ops import check_macko_arrays

METADATA_KEY = "minfer_formats"
RANDOM_KEY = "minfer_random_weights"  # "true" when the saved weights were random numbers
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")
# Written first and removed last by save_compressed, so a folder holding it (with exactly this text) is
# a save that was cut short; file names alone (config.json.partial) could be anybody's.
SAVE_MARKER = "minfer-save-in-progress"
SAVE_MARKER_TEXT = ("minfer --save-compressed is writing this folder (a compressed checkpoint); "
                    "it deletes this file once the save is complete.\n")
# What save_compressed writes (".partial": its temporary files); a folder holding anything else is not its own.
SAVED_FILES = {WEIGHTS_FILE, CONFIG_FILE, *TOKENIZER_FILES, WEIGHTS_FILE + ".partial", CONFIG_FILE + ".partial",
               SAVE_MARKER}


def check_save_target(folder: str | Path, create: bool = False) -> Path:
    """Refuse a path that is not a folder, one that cannot be written or created, and a non-empty
    folder other than an earlier compressed save (another model's files would be overwritten or
    left beside these); `create` makes a missing folder (a check alone makes nothing, so a run that
    fails later leaves no empty folder behind)."""
    folder = Path(os.path.expanduser(folder))  # os.path's leaves ~nosuchuser as it is; Path's raises
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder; pass a folder to write the model into")
    if not folder.exists():
        parent = next(p for p in folder.absolute().parents if p.exists())
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise CheckpointError(f"cannot create the folder {folder} ({parent} is not a writable folder)")
        if create:
            try:
                folder.mkdir(parents=True)
            except OSError as exc:
                raise CheckpointError(f"cannot create the folder {folder} ({exc.strerror})") from None
        return folder
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write into {folder}")
    # Hidden files (.DS_Store, ...) are left alone. Config and tokenizer files count as an earlier
    # save's only beside its weights (or in a folder whose save was cut short, as its marker says):
    # alone, they are somebody else's (e.g. the config-only folder of --macko-reference).
    names = sorted(path.name for path in folder.iterdir() if not path.name.startswith("."))
    try:
        compressed = is_compressed(folder)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}; delete it or pass a new folder") from None
    ours = compressed or _holds_save_marker(folder)
    foreign = [name for name in names
               if not ours or name not in SAVED_FILES or (name == WEIGHTS_FILE and not compressed)]
    if foreign:
        raise CheckpointError(f"{folder} holds files that are not a minfer compressed checkpoint "
                              f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                              "pass a new or empty folder")
    return folder


def _holds_save_marker(folder: Path) -> bool:
    marker = folder / SAVE_MARKER
    if marker.is_symlink() or not marker.is_file():
        return False
    with open(marker, "rb") as f:
        return f.read(len(SAVE_MARKER_TEXT) + 1) == SAVE_MARKER_TEXT.encode()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_compressed(model: nn.Module, folder: str | Path, tokenizer_path: str | Path | None = None,
                    progress: bool = False, random_weights: bool = False) -> Path:
    """Write `model` (projections in any mix of dense and MACKO) as a compressed checkpoint folder:
    a new or empty one, or one an earlier save wrote (check_save_target). Weights and config go to
    temporary files renamed only once both are complete, so an interrupted save leaves the folder's
    earlier checkpoint, if any, whole, and its marker file lets a later save take the folder.
    `random_weights` is kept in the file, so the reloaded model is still reported as random."""
    from safetensors.torch import save_file

    folder = check_save_target(folder, create=True)
    marker = folder / SAVE_MARKER
    marker.write_text(SAVE_MARKER_TEXT)
    layout = {name: {"format": linear.fmt.name, "shape": list(linear.fmt.shape)}
              for name, linear in model.projections()}
    source = model.checkpoint_tensors()
    tensors = {name: _file_copy(t)
               for name, t in tqdm(source.items(), desc="copying to host", unit="tensor", disable=not progress)}
    if progress:
        print(f"writing {sum(t.nbytes for t in tensors.values()) / 1e9:.2f} GB to {folder / WEIGHTS_FILE}",
              file=sys.stderr, flush=True)
    partial, partial_config = folder / (WEIGHTS_FILE + ".partial"), folder / (CONFIG_FILE + ".partial")
    metadata = {"format": "pt", METADATA_KEY: json.dumps(layout), RANDOM_KEY: json.dumps(random_weights)}
    try:
        save_file(tensors, partial, metadata=metadata)
        os.chmod(partial, 0o666 & ~_umask())  # safetensors creates it private; the config beside it is not
        partial_config.write_text(json.dumps(model.config.to_hf(), indent=2))
    except BaseException:
        partial.unlink(missing_ok=True)
        partial_config.unlink(missing_ok=True)
        raise  # the marker stays: the folder may hold a cut-short save's files, which a later save replaces
    partial.replace(folder / WEIGHTS_FILE)
    partial_config.replace(folder / CONFIG_FILE)
    if tokenizer_path is not None:
        target = folder / Path(tokenizer_path).name
        if not (target.exists() and target.samefile(tokenizer_path)):
            for stale in TOKENIZER_FILES:  # a leftover one would be found first
                (folder / stale).unlink(missing_ok=True)
            shutil.copyfile(tokenizer_path, target)
    marker.unlink()
    return folder


def _file_copy(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor on the host as the file stores it: float32 as float16 or bfloat16 when one of them
    holds every value exactly (a float32 CPU run of a 16-bit checkpoint), so the file keeps
    MACKO's 16-bit values; otherwise unchanged, so saving never rounds."""
    host = tensor.detach().to("cpu").contiguous()
    if host.dtype == torch.float32:
        for narrow in (torch.float16, torch.bfloat16):
            candidate = host.to(narrow)
            if torch.equal(candidate.to(torch.float32), host):
                return candidate
    return host


def _metadata(folder: Path) -> dict:
    from ..checkpoint import open_safetensors

    file = folder / WEIGHTS_FILE
    if not file.is_file():
        return {}
    with open_safetensors(file) as f:
        return f.metadata() or {}


def _metadata_json(folder: Path, key: str, default: str | None = None):
    text = _metadata(folder).get(key, default)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise CheckpointError(f"{folder / WEIGHTS_FILE} has unreadable {key} metadata ({text[:40]!r}): "
                              "the compressed checkpoint is damaged") from None


def _layout(folder: Path) -> dict | None:
    """The saved projections' formats and shapes, None when `folder` is no compressed save."""
    layout = _metadata_json(folder, METADATA_KEY)
    well_formed = isinstance(layout, dict) and all(
        isinstance(entry, dict) and isinstance(entry.get("format"), str) and isinstance(entry.get("shape"), list)
        and len(entry["shape"]) == 2 and all(isinstance(n, int) for n in entry["shape"]) for entry in layout.values())
    if layout is not None and not well_formed:
        raise CheckpointError(f"{folder / WEIGHTS_FILE} has malformed {METADATA_KEY} metadata (expected "
                              '{"<projection>": {"format": ..., "shape": [rows, cols]}, ...}): the compressed '
                              "checkpoint is damaged")
    return layout


def is_compressed(folder: str | Path) -> bool:
    """True when `folder` holds a checkpoint written by `save_compressed`."""
    return _layout(Path(folder)) is not None


def holds_random_weights(folder: str | Path) -> bool:
    """True when `folder` is a compressed checkpoint saved from random weights."""
    flag = _metadata_json(Path(folder), RANDOM_KEY, "false")
    if not isinstance(flag, bool):
        raise CheckpointError(f"{Path(folder) / WEIGHTS_FILE} has malformed {RANDOM_KEY} metadata ({flag!r}, "
                              "expected true or false)")
    return flag


def _fill(model: nn.Module, formats: dict[str, nn.Module], read, names: set[str], where: str,
          dtype: torch.dtype, device: torch.device | str, progress: bool = False, checked: bool = False) -> nn.Module:
    """Swap in `formats` (built on meta), allocate the model once, then copy every tensor from
    `read(name)`; `names` must be exactly the tensors the model holds. The formats' buffers are
    then checked (WeightFormat.check), unless the caller has `checked` what it reads."""
    for name, linear in model.projections():
        if name in formats:
            linear.set_format(formats[name])
    model.materialize(device, dtype)
    targets = model.checkpoint_tensors()
    missing, unexpected = sorted(set(targets) - names), sorted(names - set(targets))
    if missing or unexpected:
        what = f"lacks {missing[0]}" if missing else f"has unexpected {unexpected[0]}"
        raise CheckpointError(f"{where} {what}; was it written for this model's config?")
    with torch.no_grad():
        for name, target in tqdm(targets.items(), desc="loading", unit="tensor", disable=not progress):
            source = read(name)
            if tuple(source.shape) != tuple(target.shape):
                raise CheckpointError(f"tensor {name} in {where} has shape {tuple(source.shape)}, "
                                      f"expected {tuple(target.shape)}")
            # floats load at any float dtype; indices and nibbles must be stored as what they are
            if source.is_floating_point() != target.is_floating_point() or (
                    not target.is_floating_point() and source.dtype != target.dtype):
                wanted = "a float tensor" if target.is_floating_point() else str(target.dtype)
                raise CheckpointError(f"tensor {name} in {where} is {source.dtype}, expected {wanted}")
            target.copy_(source)
    if not checked:
        for name, linear in model.projections():
            try:
                linear.fmt.check()
            except FormatError as exc:
                raise CheckpointError(f"{name} in {where}: {exc}") from None
    return model


def load_compressed(model: nn.Module, folder: str | Path, dtype: torch.dtype, device: torch.device | str,
                    progress: bool = False) -> nn.Module:
    """Fill a meta-built Transformer from a folder written by `save_compressed`."""
    from ..checkpoint import open_safetensors

    folder = Path(folder)
    layout = _layout(folder)
    if layout is None:
        raise CheckpointError(f"{folder} is not a minfer compressed checkpoint (no {METADATA_KEY} metadata)")
    file = folder / WEIGHTS_FILE
    with ExitStack() as stack:
        f = stack.enter_context(open_safetensors(file))
        formats = {}
        for name, linear in model.projections():
            entry = layout.get(name)
            if entry is None:
                raise CheckpointError(f"{file} has no projection {name}; was it written for this model's config?")
            if tuple(entry["shape"]) != linear.fmt.shape:
                raise CheckpointError(f"{name} in {file} has shape {tuple(entry['shape'])}, "
                                      f"expected {linear.fmt.shape}")
            if entry["format"] == MackoWeight.name:
                values_key = f"{name}.fmt.values"
                if values_key not in f.keys():
                    raise CheckpointError(f"{file} has no tensor {values_key}; the compressed folder is incomplete")
                values_shape = f.get_slice(values_key).get_shape()
                if len(values_shape) != 1 or values_shape[0] % 8:
                    raise CheckpointError(f"tensor {values_key} in {file} has shape {tuple(values_shape)}; MACKO "
                                          "values are 1-D with a multiple of 8 entries: the file is damaged")
                deltas_key = f"{name}.fmt.deltas"
                deltas_shape = f.get_slice(deltas_key).get_shape() if deltas_key in f.keys() else None
                if deltas_shape is not None and deltas_shape != [values_shape[0] // 2]:
                    raise CheckpointError(f"{values_key} ({values_shape[0]} entries) and {deltas_key} (shape "
                                          f"{tuple(deltas_shape)}) in {file} disagree: MACKO stores one nibble "
                                          "per value; the file is damaged")
                formats[name] = MackoWeight.empty(linear.fmt.shape, values_shape[0], dtype, "meta")
            elif entry["format"] != DenseWeight.name:
                known = ", ".join(sorted(FORMATS))
                raise CheckpointError(f"{name} in {file} uses format {entry['format']!r}; loadable: {known}")
        return _fill(model, formats, f.get_tensor, set(f.keys()), str(file), dtype, device, progress)


def _reference_tensors(file: Path) -> dict[str, torch.Tensor | int]:
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(file)))
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            raise CheckpointError(f"{file} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(f"{file} is not a macko_spmv compressed checkpoint readable without pickle code "
                              f"execution ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} holds a {type(state).__name__}, not a dict of tensors")
    return state


def _reference_size(value, key: str, file: Path) -> int:
    """A matrix size stored by the reference compressor: an int, or a one-element integer tensor."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise CheckpointError(f"{key} in {file} must be an integer (the matrix's rows or columns), got {str(value)[:40]!r}")


def load_reference_macko(model: nn.Module, file: str | Path, dtype: torch.dtype,
                         device: torch.device | str, progress: bool = False) -> nn.Module:
    """Fill a meta-built Transformer from the reference tool's compressed checkpoint: its q/k/v and
    gate/up matrices are stacked into minfer's fused projections (concatenating MACKO rows equals
    compressing the stacked matrix), everything else is copied by HF name."""
    from ..checkpoint import hf_tensor_map

    file = Path(file)
    state = _reference_tensors(file)
    layout = hf_tensor_map(model.config)
    parts: dict[str, list] = {}
    for hf_name, (target, row, shape) in layout.items():
        if not target.endswith(".fmt.weight") or target.startswith("lm_head"):
            continue
        keys = [hf_name.removesuffix("weight") + f"c_{i}" for i in range(5)]
        if any(k not in state for k in keys):
            raise CheckpointError(f"{file} lacks {next(k for k in keys if k not in state)}; the reference "
                                  "compressor stores <name>.c_0 ... .c_4 for every attention and MLP weight")
        rows, cols = (_reference_size(state[k], k, file) for k in keys[3:])
        if (rows, cols) != shape:
            raise CheckpointError(f"{keys[0]} in {file} is {rows}x{cols}, expected {shape[0]}x{shape[1]}")
        arrays = [state[k] for k in keys[:3]]
        if not all(isinstance(a, torch.Tensor) for a in arrays):
            raise CheckpointError(f"{keys[0]} .. {keys[2]} in {file} must be tensors (values, deltas, row_ptr)")
        try:
            check_macko_arrays(*arrays, cols)
        except FormatError as exc:
            raise CheckpointError(f"{keys[0]} .. {keys[2]} in {file}: {exc}") from None
        parts.setdefault(target.removesuffix(".weight"), []).append((row, arrays))
    formats = {}
    fused: dict[str, tuple[torch.Tensor, ...]] = {}
    for fmt_name, pieces in tqdm(parts.items(), desc="stacking q/k/v and gate/up rows", unit="matrix",
                                 disable=not progress):
        arrays = concat_rows([tuple(p) for _, p in sorted(pieces, key=lambda item: item[0])])
        fused[fmt_name] = arrays
        name = fmt_name.removesuffix(".fmt")
        shape = dict(model.projections())[name].fmt.shape
        formats[name] = MackoWeight.empty(shape, arrays[0].numel(), dtype, "meta")
    names = {f"{n}.{b}" for n in fused for b in ("values", "deltas", "row_ptr")}
    dense = {target: hf_name for hf_name, (target, _, _) in layout.items() if not target.endswith(".fmt.weight")
             or target.startswith("lm_head")}
    for hf_name in sorted(dense.values()):
        if not isinstance(state.get(hf_name), torch.Tensor):
            what = "lacks" if hf_name not in state else "holds no tensor under"
            raise CheckpointError(f"{file} {what} {hf_name}; the reference compressor keeps every tensor it does "
                                  "not compress (embeddings, norms, lm_head) under its HF name")

    def read(name: str) -> torch.Tensor:
        if name in dense:
            return state[dense[name]]
        fmt_name, buffer = name.rsplit(".", 1)
        return fused[fmt_name][("values", "deltas", "row_ptr").index(buffer)]

    return _fill(model, formats, read, names | set(dense), str(file), dtype, device, progress, checked=True)


# Bytes per element of safetensors' non-float dtypes (floats are counted at the loading dtype).
_STORED_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8, "I64": 8}


def stored_weight_bytes(path: str | Path, dtype: torch.dtype) -> int:
    """What the weights in `path` (a compressed folder, or a reference checkpoint file) take once
    loaded in `dtype`: float tensors at dtype's size, the rest (deltas, row_ptr) as stored. Read
    from the safetensors header; a torch.save file is not opened: its size stands in, scaled for a
    dtype wider than its fp16 values."""
    from ..checkpoint import open_safetensors

    path = Path(path)
    file = path / WEIGHTS_FILE if path.is_dir() else path
    if file.suffix != ".safetensors":
        return math.ceil(file.stat().st_size * max(1.0, dtype.itemsize / 2))
    total = 0
    with open_safetensors(file) as f:
        for name in f.keys():
            tensor = f.get_slice(name)
            total += math.prod(tensor.get_shape()) * _STORED_BYTES.get(tensor.get_dtype(), dtype.itemsize)
    return total
