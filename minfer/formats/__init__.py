"""Weight formats, by name, and `convert`: the one place `--sparse` goes through.

Every module of this package is imported here, so a format registers itself (`@register` in its own
module) and nothing lists the formats by hand.
"""

from __future__ import annotations

import importlib
import pkgutil

from torch import nn
from tqdm.auto import tqdm

from .base import FORMATS, WeightFormat, WeightStats, format_choices, format_class, register
from .dense import DenseWeight



def _import_every_module() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_every_module()


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


__all__ = ["FORMATS", "DenseWeight", "WeightFormat", "WeightStats", "convert", "format_choices", "format_class",
           "register"]
