"""GEMV cases: the Llama-2-7B / Llama-3-8B decode projections against F.linear (cuBLAS)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import ops
from .kernel_suite import KernelCase, register

# (N, K): fused qkv, o, fused gate_up, down, lm_head (Llama-2), lm_head (Llama-3).
DECODE_SHAPES = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (32000, 4096), (128256, 4096)]
TOKEN_COUNTS = (1, 8)


def gemv_case(n: int, k: int, tokens: int, dtype: torch.dtype) -> KernelCase:
    def build(copies):
        weights = [(torch.randn(n, k, device="cuda") / k**0.5).to(dtype) for _ in range(copies)]
        x = torch.randn(tokens, k, device="cuda", dtype=dtype)
        out = torch.empty(tokens, n, device="cuda", dtype=dtype)
        return (lambda i: ops.gemv(x, weights[i], out=out)), (lambda i: F.linear(x, weights[i]))

    size = torch.finfo(dtype).bits // 8
    return KernelCase(op="gemv", shape=f"{n}x{k} t{tokens}", dtype=dtype, bytes=size * (n * k + tokens * (n + k)),
                      flops=2 * n * k * tokens, build=build, baseline="F.linear")


def gemv_cases(dtype: torch.dtype) -> list[KernelCase]:
    return [gemv_case(n, k, tokens, dtype) for tokens in TOKEN_COUNTS for n, k in DECODE_SHAPES]


register("gemv", gemv_cases)
