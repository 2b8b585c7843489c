"""Weight formats, by name, and `convert`: the one place `--sparse` goes through."""

from __future__ import annotations

from torch import nn
from tqdm.auto import tqdm

from ..errors import FormatError
from .base import WeightFormat
from .dense import DenseWeight
from .macko import MackoWeight

FORMATS: dict[str, type[WeightFormat]] = {DenseWeight.name: DenseWeight, MackoWeight.name: MackoWeight}
ALIASES = {"none": DenseWeight.name}


def format_class(spec: str) -> type[WeightFormat]:
    name = ALIASES.get(spec, spec)
    if name not in FORMATS:
        choices = ", ".join(sorted([*FORMATS, *ALIASES]))
        raise FormatError(f"unknown weight format {spec!r}; choose one of: {choices}")
    return FORMATS[name]


def convert(model: nn.Module, spec: str, progress: bool = False, **options) -> nn.Module:
    """Re-encode every projection of `model` (attention and MLP linears) in format `spec`.

    Embeddings and lm_head stay dense. Layers are converted one at a time, so at most one
    extra matrix is alive at once. `options` go to the format's `from_dense`.
    """
    cls = format_class(spec)
    projections = list(model.projections())
    for _, linear in tqdm(projections, desc=f"converting to {cls.name}", unit="matrix", disable=not progress):
        if not isinstance(linear.fmt, cls):  # already in this format (e.g. loaded compressed)
            linear.set_format(cls.from_dense(linear.fmt.to_dense(), **options))
    return model


__all__ = ["FORMATS", "WeightFormat", "DenseWeight", "MackoWeight", "convert", "format_class"]
