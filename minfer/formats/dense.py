"""Dense storage: the [N, K] matrix as it is, multiplied with torch's F.linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import FormatError
from .base import WeightFormat


class DenseWeight(WeightFormat):
    name = "dense"

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2:
            raise FormatError(f"a dense weight must be a 2-D [out, in] matrix, got shape {tuple(weight.shape)}")
        super().__init__(*weight.shape)
        self.register_buffer("weight", weight)

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> DenseWeight:
        return cls(weight)

    def to_dense(self) -> torch.Tensor:
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
