"""2:4 GEMV cases: Llama-2-7B projections pruned to 2:4 by magnitude, against cuBLAS on the dense matrix.

Bytes are the 2:4 format's own (values 2 bytes per kept weight, 4 bits of metadata per group of 4) plus x and
y. `minfer.bench.sparse24_suite` (apps/benchmark.py --suite sparse24) compares more baselines and token counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import ops
from ..formats.sparse24 import compress
from ..sparsity.prune import prune_to_structure_
from .cases_macko import LLAMA2_7B_SHAPES, rotated
from .kernel_suite import KernelCase, register

TOKEN_COUNTS = (1, 8, 16)


def matrix_24(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A random [n, k] matrix on the GPU keeping the 2 largest |w| of every 4 columns."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    weight = (torch.randn(n, k, device="cuda", generator=generator) / (k / 2) ** 0.5).to(dtype)
    return prune_to_structure_(weight, weight.abs(), (2, 4))


def sparse24_bytes(values: torch.Tensor, meta: torch.Tensor, n: int, k: int, tokens: int) -> int:
    """The fewest bytes one product moves: the arrays once, x read and y written."""
    size = values.element_size()
    return values.numel() * size + meta.numel() * 4 + size * tokens * (n + k)


def sparse24_case(n: int, k: int, tokens: int, dtype: torch.dtype, dense: torch.Tensor) -> KernelCase:
    values, meta = compress(dense)

    def build(copies):
        sparse = rotated((values, meta, ops.sparse24_gemv_metadata(meta)), copies)
        dense_copies = rotated((dense,), copies)
        x = torch.randn(tokens, k, device="cuda", dtype=dtype)
        out = torch.empty(tokens, n, device="cuda", dtype=dtype)
        return ((lambda i: ops.sparse24_gemv(x, *sparse[i], out)), (lambda i: F.linear(x, dense_copies[i][0])))

    return KernelCase(op="sparse24", shape=f"{n}x{k} t{tokens}", dtype=dtype,
                      bytes=sparse24_bytes(values, meta, n, k, tokens), flops=n * k * tokens, build=build,
                      baseline="F.linear dense")


def sparse24_cases(dtype: torch.dtype) -> list[KernelCase]:
    dense = {(n, k): matrix_24(n, k, dtype) for n, k in LLAMA2_7B_SHAPES}
    return [sparse24_case(n, k, t, dtype, dense[n, k]) for t in TOKEN_COUNTS for n, k in LLAMA2_7B_SHAPES]


register("sparse24", sparse24_cases)
