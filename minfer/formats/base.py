"""The weight-format contract and its registry: how a projection's [N, K] matrix is stored and multiplied.

A `Linear` layer holds exactly one `WeightFormat` as its child module `fmt`. A new storage scheme is one
module in this package whose class is decorated with `@register`: the package imports every module it
holds, so the CLI's --sparse choices, the reports, compressed save/load and the contract tests find the
format by itself (docs/contributing.md lists the touch points).
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from .. import ops
from ..errors import FormatError


@dataclass(frozen=True)
class WeightStats:
    """What the sparsity report shows of one matrix."""

    elements: int  # rows x cols
    nonzeros: int
    stored_bytes: int  # what this format holds (and a decode step reads)
    dense_bytes: int  # the same matrix stored dense in the format's value dtype
    rows_larger_than_dense: int = 0  # rows whose encoding outweighs the dense row

    @property
    def density(self) -> float:
        return self.nonzeros / max(self.elements, 1)


class WeightFormat(nn.Module, metaclass=ABCMeta):
    """A weight matrix W of shape (N, K) in some storage format; forward(x) = x @ W.T.

    Subclasses keep their tensors as buffers (so `.to()`, `state_dict()` and `nbytes` see them; the
    buffers are what a compressed checkpoint stores) and record the logical shape in `out_features` (N)
    and `in_features` (K).
    """

    name: ClassVar[str]  # the --sparse value and the format recorded in compressed checkpoints
    aliases: ClassVar[tuple[str, ...]] = ()  # other --sparse values meaning this format
    # Another tool's checkpoint format that `from_reference` imports (help text of --<name>-reference), or None.
    reference: ClassVar[str | None] = None
    # (N, M) when `from_dense` needs N:M structure (at most N nonzeros in every M consecutive columns of a
    # row): the sparsity CLI prunes to it, by magnitude or wanda, instead of to a --density.
    structure: ClassVar[tuple[int, int] | None] = None

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.out_features = out_features
        self.in_features = in_features

    @classmethod
    @abstractmethod
    def from_dense(cls, weight: torch.Tensor, **options) -> WeightFormat:
        """Encode a dense [N, K] matrix as it is (pruning is sparsity.prune's job, before this); `options`
        are the format's settings, as `options()` returns them."""

    @classmethod
    @abstractmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int],
                     options: Mapping[str, object]) -> WeightFormat:
        """The format holding `tensors` (what `tensors()` returned, possibly on the meta device) for a matrix
        of `shape`, with the `options()` it was saved with. Raises FormatError when a tensor is missing,
        extra, or of the wrong dtype or size; `check` then inspects the values once they are filled."""

    @abstractmethod
    def to_dense(self) -> torch.Tensor:
        """The [N, K] matrix this format represents (in its storage dtype)."""

    @abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x[..., K] -> [..., N]."""

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """The dtype of the matrix's values."""

    def project(self, x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                residual: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
        """The step a Llama sublayer takes around a projection: forward(RMSNorm(x)) with `norm_weight`;
        with `silu_mul` (the MLP's [gate; up] matrix) silu(gate) * up of that; added into `residual` in
        place (and returned) when one is given. This version runs the norm, the activation and the add
        as ops of their own; a format whose decode kernel fuses them overrides it."""
        if norm_weight is not None:
            x = ops.rms_norm(x, norm_weight, eps)
        y = self(x)
        if silu_mul:
            y = ops.silu_mul(y)
        return y if residual is None else residual.add_(y)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Name -> tensor: what a compressed checkpoint stores of this matrix. These are its buffers, under
        their names, since a loader fills the buffers of a `from_tensors` instance in place."""
        return dict(self.named_buffers())

    def options(self) -> dict:
        """JSON-serializable settings that `from_tensors` needs beside the tensors and the shape."""
        return {}

    def check(self) -> None:
        """Raise FormatError when the stored values do not encode a matrix of `shape` (loaders run it on
        what they read from files; a dense matrix always does)."""

    def stats(self) -> WeightStats:
        """Sizes and nonzeros for the sparsity report (this version decodes the matrix to count them)."""
        dense = self.to_dense()
        rows, cols = self.shape
        return WeightStats(rows * cols, int(torch.count_nonzero(dense)), self.nbytes,
                           rows * cols * dense.element_size())

    @classmethod
    def from_reference(cls, tensors: Mapping[str, object], parts: list[tuple[str, tuple[int, int]]],
                       where: str) -> WeightFormat:
        """The matrix whose row blocks `parts` ((HF weight name, shape) in row order) another tool's checkpoint
        `where` stores in `tensors`, its arrays checked; only formats that set `reference` implement it."""
        raise FormatError(f"the {cls.name} format imports no other tool's checkpoints")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes a forward pass reads from this format's storage (every buffer it holds)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        return f"{self.name}, shape={self.shape}"


def expect_tensors(fmt: type[WeightFormat], tensors: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> None:
    """Raise FormatError unless `tensors` holds exactly `names` (for `from_tensors`)."""
    missing, extra = [n for n in names if n not in tensors], sorted(set(tensors) - set(names))
    if missing or extra:
        what = f"lacks its tensor {missing[0]!r}" if missing else f"has an unexpected tensor {extra[0]!r}"
        raise FormatError(f"a {fmt.name} weight holds the tensors {', '.join(names)}; this one {what}")


FORMATS: dict[str, type[WeightFormat]] = {}  # name -> class, filled by @register as the modules load


def register(cls: type[WeightFormat]) -> type[WeightFormat]:
    """Class decorator: make `cls` a weight format under `cls.name` and `cls.aliases`."""
    for spec in (cls.name, *cls.aliases):
        taken = format_named(spec)
        if taken is not None and taken is not cls:
            raise FormatError(f"two weight formats are named {spec!r}: {taken.__qualname__} and {cls.__qualname__}")
    FORMATS[cls.name] = cls
    return cls


def format_named(spec: str) -> type[WeightFormat] | None:
    return FORMATS.get(spec) or next((cls for cls in FORMATS.values() if spec in cls.aliases), None)


def format_choices() -> list[str]:
    """Every --sparse value: the formats' names and aliases."""
    return sorted(spec for cls in FORMATS.values() for spec in (cls.name, *cls.aliases))


def format_class(spec: str) -> type[WeightFormat]:
    """The format a --sparse value (a name or an alias) names."""
    cls = format_named(spec)
    if cls is None:
        raise FormatError(f"unknown weight format {spec!r}; choose one of: {', '.join(format_choices())}")
    return cls
