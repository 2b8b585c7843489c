"""Importing another tool's compressed checkpoint: the projections in a weight format whose `reference`
says which tool's files it reads (`WeightFormat.from_reference`), everything else under its HF name.

Such files are written with `torch.save` (macko_spmv's compression script does) or as safetensors. A
torch.save file is read with `torch.load(weights_only=True)`, which refuses anything but tensors and
plain containers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from tqdm.auto import tqdm

from ..checkpoint import hf_tensor_map
from ..errors import CheckpointError
from ..formats import FORMATS, WeightFormat
from .compressed import fill_model


def reference_formats() -> list[type[WeightFormat]]:
    """The registered formats that import another tool's checkpoints."""
    return [cls for _, cls in sorted(FORMATS.items()) if cls.reference is not None]


def reference_tensors(file: Path) -> dict[str, torch.Tensor | int]:
    """Name -> tensor (or int) of a torch.save or safetensors file."""
    if file.suffix == ".safetensors":
        try:
            return dict(load_file(str(file)))
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            raise CheckpointError(f"{file} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(f"{file} is not a compressed checkpoint readable without pickle code execution "
                              f"({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} holds a {type(state).__name__}, not a dict of tensors")
    return state


def load_reference(model: nn.Module, fmt: type[WeightFormat], file: str | Path, dtype: torch.dtype,
                   device: torch.device | str, progress: bool = False) -> nn.Module:
    """Fill a meta-built Transformer from another tool's checkpoint `file` holding its projections in format
    `fmt`: the HF matrices of each fused projection (q/k/v, gate/up) are stacked by the format, every
    other tensor is copied by HF name."""
    file = Path(file)
    state = reference_tensors(file)
    layout = hf_tensor_map(model.config)
    projections = {f"{name}.fmt.weight": name for name, _ in model.projections()}
    parts: dict[str, list[tuple[int, str, tuple[int, int]]]] = {}
    dense: dict[str, str] = {}  # minfer name -> HF name
    for hf_name, (target, row, shape) in layout.items():
        if target in projections:
            parts.setdefault(projections[target], []).append((row, hf_name, shape))
        else:
            dense[target] = hf_name
    formats, sources = {}, {}
    for name, pieces in tqdm(parts.items(), desc="importing the projections", unit="matrix", disable=not progress):
        imported = fmt.from_reference(state, [(hf_name, shape) for _, hf_name, shape in sorted(pieces)], str(file))
        sources |= {f"{name}.fmt.{key}": tensor for key, tensor in imported.tensors().items()}
        formats[name] = fmt.from_tensors({key: tensor.to("meta") for key, tensor in imported.tensors().items()},
                                         imported.shape, imported.options())
    for hf_name in sorted(dense.values()):
        if not isinstance(state.get(hf_name), torch.Tensor):
            what = "lacks" if hf_name not in state else "holds no tensor under"
            raise CheckpointError(f"{file} {what} {hf_name}; the reference compressor keeps every tensor it does "
                                  "not compress (embeddings, norms, lm_head) under its HF name")
    sources |= {target: state[hf_name] for target, hf_name in dense.items()}
    return fill_model(model, formats, sources.__getitem__, set(sources), str(file), dtype, device, progress,
                      checked=True)
