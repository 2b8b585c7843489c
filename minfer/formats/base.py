"""The weight-format contract: how a projection's [N, K] matrix is stored and multiplied.

A `Linear` layer holds exactly one `WeightFormat` as its child module `fmt`, so a new storage
scheme (sparse, factorized, ...) is one subclass here plus its kernel, and the model never changes.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from typing import ClassVar

import torch
from torch import nn

from .. import ops


class WeightFormat(nn.Module, metaclass=ABCMeta):
    """A weight matrix W of shape (N, K) in some storage format; forward(x) = x @ W.T.

    Subclasses keep their tensors as buffers (so `.to()`, `state_dict()` and `nbytes` see them)
    and record the logical shape in `out_features` (N) and `in_features` (K).
    """

    name: ClassVar[str]

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.out_features = out_features
        self.in_features = in_features

    @classmethod
    @abstractmethod
    def from_dense(cls, weight: torch.Tensor, **options) -> WeightFormat:
        """Encode a dense [N, K] matrix; options are format-specific (density, block size, ...)."""

    @abstractmethod
    def to_dense(self) -> torch.Tensor:
        """The [N, K] matrix this format represents (in its storage dtype)."""

    @abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x[..., K] -> [..., N]."""

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

    def check(self) -> None:
        """Raise FormatError when the stored buffers do not encode a matrix of `shape` (loaders run it
        on what they read from files; a dense matrix always does)."""

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes a forward pass reads from this format's storage (every buffer it holds)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        return f"{self.name}, shape={self.shape}"
