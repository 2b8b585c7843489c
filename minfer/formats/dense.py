"""Dense storage: the [N, K] matrix as it is. On a GPU with the minfer backend, decode (1..8 tokens)
runs minfer's GEMV and longer inputs its HGEMM; anything else goes through torch's F.linear."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from .. import ops
from ..errors import FormatError
from .base import WeightFormat, expect_tensors, register


@register
class DenseWeight(WeightFormat):
    name = "dense"
    aliases = ("none",)

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2:
            raise FormatError(f"a dense weight must be a 2-D [out, in] matrix, got shape {tuple(weight.shape)}")
        super().__init__(*weight.shape)
        self.register_buffer("weight", weight)

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> DenseWeight:
        return cls(weight)

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int],
                     options: Mapping[str, object]) -> DenseWeight:
        expect_tensors(cls, tensors, ("weight",))
        weight = tensors["weight"]
        if tuple(weight.shape) != tuple(shape) or not weight.is_floating_point():
            raise FormatError(f"a dense weight of shape {tuple(shape)} is a float tensor of that shape, got "
                              f"{weight.dtype} {tuple(weight.shape)}")
        return cls(weight)

    def to_dense(self) -> torch.Tensor:
        return self.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def _runs_kernels(self, x: torch.Tensor) -> bool:
        return x.dtype == self.weight.dtype and x.dtype in (torch.float16, torch.bfloat16) and ops.use_kernels(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // max(x.shape[-1], 1)
        n, k = self.weight.shape
        if self._runs_kernels(x):
            if 1 <= tokens <= ops.GEMV_MAX_TOKENS:
                return ops.gemv(x, self.weight)
            if n % 8 == 0 and k % 8 == 0:
                return ops.hgemm(x, self.weight)
        return F.linear(x, self.weight)

    def project(self, x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                residual: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
        """Decode runs the norm, the MLP activation and the residual add inside the GEMV (no kernels
        of their own)."""
        tokens = x.numel() // max(x.shape[-1], 1)
        fused = self._runs_kernels(x) and 1 <= tokens <= ops.GEMV_MAX_TOKENS and not (silu_mul and residual is not None)
        if fused:
            return ops.gemv(x, self.weight, out=residual, norm_weight=norm_weight, eps=eps,
                            accumulate=residual is not None, silu_mul=silu_mul)
        return super().project(x, norm_weight, eps, residual, silu_mul)
