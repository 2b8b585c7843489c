"""Compressed checkpoints: prune and compress once, then start fast.

A compressed folder holds config.json, the tokenizer, and one model.safetensors with every tensor
under its minfer name (a projection's as `<projection>.fmt.<tensor>`, the tensors its format's
`tensors()` names; the rest as `embed_tokens.weight`, ...) plus a metadata entry `minfer_formats`:
JSON mapping each projection to its format's name, shape and options (a KS chain's patterns, a MACKO
matrix's density). config.json repeats that map under `"minfer": {"formats": ...}` for whoever reads the
folder; the loader reads the file's metadata and refuses a folder whose two copies disagree. It loads like any checkpoint
folder (`--model DIR`): each format rebuilds itself on the meta device from the file's tensor
headers (`WeightFormat.from_tensors`), the model is allocated once on the target device and filled
from the memory-mapped file, and each format checks what it read (`WeightFormat.check`). Folders
written before options were recorded load with no options.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import CheckpointError, FormatError
from ..formats import WeightFormat, format_choices, format_class
from ..safetensors_io import DTYPES, open_safetensors, stored_dtype

METADATA_KEY = "minfer_formats"
RANDOM_KEY = "minfer_random_weights"  # "true" when the saved weights were random numbers
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
CONFIG_ENTRY = "minfer"  # config.json's copy of the layout: {"minfer": {"formats": <the METADATA_KEY map>}}
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
    """Write `model` (projections in any mix of formats) as a compressed checkpoint folder:
    a new or empty one, or one an earlier save wrote (check_save_target). Weights and config go to
    temporary files renamed only once both are complete, so an interrupted save leaves the folder's
    earlier checkpoint, if any, whole, and its marker file lets a later save take the folder.
    `random_weights` is kept in the file, so the reloaded model is still reported as random."""
    from safetensors.torch import save_file

    folder = check_save_target(folder, create=True)
    marker = folder / SAVE_MARKER
    marker.write_text(SAVE_MARKER_TEXT)
    projections = dict(model.projections())
    layout = {name: {"format": linear.fmt.name, "shape": list(linear.fmt.shape), "options": linear.fmt.options()}
              for name, linear in projections.items()}
    source = model.checkpoint_tensors() | {f"{name}.fmt.{key}": tensor for name, linear in projections.items()
                                           for key, tensor in linear.fmt.tensors().items()}
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
        partial_config.write_text(json.dumps(model.config.to_hf() | {CONFIG_ENTRY: {"formats": layout}}, indent=2))
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
    holds every value exactly (a float32 CPU run of a 16-bit checkpoint), so the file keeps a
    format's 16-bit values; otherwise unchanged, so saving never rounds."""
    host = tensor.detach().to("cpu").contiguous()
    if host.dtype == torch.float32:
        for narrow in (torch.float16, torch.bfloat16):
            candidate = host.to(narrow)
            if torch.equal(candidate.to(torch.float32), host):
                return candidate
    return host


def _metadata(folder: Path) -> dict:
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
        and len(entry["shape"]) == 2 and all(isinstance(n, int) for n in entry["shape"])
        and isinstance(entry.get("options", {}), dict) for entry in layout.values())
    if layout is not None and not well_formed:
        raise CheckpointError(f"{folder / WEIGHTS_FILE} has malformed {METADATA_KEY} metadata (expected "
                              '{"<projection>": {"format": ..., "shape": [rows, cols], "options": {...}}, ...}): '
                              "the compressed checkpoint is damaged")
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


def fill_model(model: nn.Module, formats: dict[str, WeightFormat], read, names: set[str], where: str,
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
    folder = Path(folder)
    layout = _layout(folder)
    if layout is None:
        raise CheckpointError(f"{folder} is not a minfer compressed checkpoint (no {METADATA_KEY} metadata)")
    _check_config_copy(folder, layout)
    file = folder / WEIGHTS_FILE
    with open_safetensors(file) as f:
        names = set(f.keys())
        formats = {}
        for name, linear in model.projections():
            entry = layout.get(name)
            if entry is None:
                raise CheckpointError(f"{file} has no projection {name}; was it written for this model's config?")
            if tuple(entry["shape"]) != linear.fmt.shape:
                raise CheckpointError(f"{name} in {file} has shape {tuple(entry['shape'])}, "
                                      f"expected {linear.fmt.shape}")
            try:
                cls = format_class(entry["format"])
            except FormatError:
                raise CheckpointError(f"{name} in {file} uses format {entry['format']!r}; loadable: "
                                      f"{', '.join(format_choices())}") from None
            prefix = f"{name}.fmt."
            stored = {key.removeprefix(prefix): _meta_tensor(f, key, dtype, str(file))
                      for key in names if key.startswith(prefix)}
            try:
                formats[name] = cls.from_tensors(stored, linear.fmt.shape, entry.get("options", {}))
            except FormatError as exc:
                raise CheckpointError(f"{name} in {file}: {exc}; the compressed folder is damaged") from None
        return fill_model(model, formats, f.get_tensor, names, str(file), dtype, device, progress)


def _check_config_copy(folder: Path, layout: dict) -> None:
    """Refuse a folder whose config.json lists other formats than its weights file (an edited config);
    folders saved before config.json carried the copy have none to compare."""
    try:
        copy = json.loads((folder / CONFIG_FILE).read_text()).get(CONFIG_ENTRY, {}).get("formats")
    except (OSError, json.JSONDecodeError, AttributeError):
        return  # the config reader reports a missing or unreadable config.json itself
    if copy is not None and copy != json.loads(json.dumps(layout)):
        differing = sorted(name for name in set(copy) | set(layout) if copy.get(name) != layout.get(name))
        raise CheckpointError(f"{folder / CONFIG_FILE} lists other formats under \"{CONFIG_ENTRY}\" than "
                              f"{WEIGHTS_FILE} holds ({', '.join(differing[:3])}"
                              f"{', ...' if len(differing) > 3 else ''}); restore the saved config.json")


def _meta_tensor(handle, name: str, dtype: torch.dtype, where: str) -> torch.Tensor:
    """Tensor `name` of the open file as the loaded model will hold it, on the meta device: floats in
    `dtype`, anything else as stored."""
    stored = stored_dtype(handle, name, where)
    return torch.empty(handle.get_slice(name).get_shape(), dtype=dtype if stored.is_floating_point else stored,
                       device="meta")


def stored_weight_bytes(path: str | Path, dtype: torch.dtype) -> int:
    """What the weights in `path` (a compressed folder, or a reference checkpoint file) take once
    loaded in `dtype`: float tensors at dtype's size, the rest (deltas, row_ptr) as stored. Read
    from the safetensors header; a torch.save file is not opened: its size stands in, scaled for a
    dtype wider than its fp16 values."""
    path = Path(path)
    file = path / WEIGHTS_FILE if path.is_dir() else path
    if file.suffix != ".safetensors":
        return math.ceil(file.stat().st_size * max(1.0, dtype.itemsize / 2))
    total = 0
    with open_safetensors(file) as f:
        for name in f.keys():
            tensor = f.get_slice(name)
            stored = DTYPES.get(tensor.get_dtype(), dtype)
            total += math.prod(tensor.get_shape()) * (dtype if stored.is_floating_point else stored).itemsize
    return total
