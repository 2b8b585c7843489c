"""The weight-format contract: how a projection's [N, K] matrix is stored and multiplied.

A `Linear` layer holds exactly one `WeightFormat` as its child module `fmt`, so a new storage
scheme (sparse, factorized, ...) is one subclass here plus its kernel, and the model never changes.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from .. import ops


@dataclass(frozen=True)
class RotaryCacheWrite:
    """Where the attention's qkv step puts its keys and values: HF half-split RoPE tables (fp32
    [>= S, D/2]), the positions [T], and the [B, Hkv, S, D] caches."""

    cos: torch.Tensor
    sin: torch.Tensor
    input_pos: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int


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

    def project_qkv(self, x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                    write: RotaryCacheWrite) -> torch.Tensor:
        """The attention's qkv step, this matrix being [q; k; v] heads: project(x, norm) [B, T, N], RoPE
        on q and k, k and v written into the caches at the positions; returns q [B, T, Hq, D]. This
        version runs ops.rope_write_kv after the projection; a format may fuse both."""
        batch, seq = x.shape[:2]
        d = write.head_dim
        q, k, v = self.project(x, norm_weight, eps).split(
            [write.num_heads * d, write.num_kv_heads * d, write.num_kv_heads * d], dim=-1)
        q = q.view(batch, seq, write.num_heads, d)
        ops.rope_write_kv(q, k.view(batch, seq, write.num_kv_heads, d), v.view(batch, seq, write.num_kv_heads, d),
                          write.cos, write.sin, write.input_pos, write.k_cache, write.v_cache)
        return q

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes a forward pass reads from this format's storage (every buffer it holds)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        return f"{self.name}, shape={self.shape}"
