"""Reading safetensors files: opening one with damage reported in one line, and its dtype names."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from .errors import CheckpointError

# safetensors' dtype names (a file header's "dtype") -> torch dtypes.
DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "U16": torch.uint16, "I16": torch.int16,
          "U32": torch.uint32, "I32": torch.int32, "U64": torch.uint64, "I64": torch.int64, "F16": torch.float16,
          "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def open_safetensors(file: Path):
    """safe_open on the CPU, with truncated or corrupt files reported as a CheckpointError naming the file."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own SafetensorError for bad headers
        raise CheckpointError(f"{file} is truncated or corrupt ({e}); download or write it again") from None


def stored_dtype(handle, name: str, where: str) -> torch.dtype:
    """The dtype tensor `name` has in the open file `handle` (`where` names the file in errors)."""
    dtype = handle.get_slice(name).get_dtype()
    if dtype not in DTYPES:
        raise CheckpointError(f"tensor {name} in {where} has dtype {dtype}, which minfer does not load")
    return DTYPES[dtype]
