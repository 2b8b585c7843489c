"""HGEMM cases: the Llama-2-7B prefill projections at 16..16384 tokens against torch.mm (cuBLAS).

minfer.bench.hgemm_suite times every kernel variant side by side; these cases time the one
`ops.hgemm` picks ("auto") for the kernel suite.
"""

from __future__ import annotations

import torch

from .. import ops
from .hgemm_suite import LLAMA_SHAPES, TOKENS
from .kernel_suite import KernelCase, register


def hgemm_case(m: int, n: int, k: int, dtype: torch.dtype) -> KernelCase:
    def build(copies):
        xs = [torch.randn(m, k, device="cuda", dtype=dtype) for _ in range(copies)]
        ws = [(torch.randn(n, k, device="cuda") / k**0.5).to(dtype) for _ in range(copies)]
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        return (lambda i: ops.hgemm(xs[i], ws[i], out=out)), (lambda i: torch.mm(xs[i], ws[i].t(), out=out))

    size = torch.finfo(dtype).bits // 8
    return KernelCase(op="hgemm", shape=f"{n}x{k} m{m}", dtype=dtype, bytes=size * (m * k + n * k + m * n),
                      flops=2 * m * n * k, build=build, baseline="torch.mm", bound="compute")


def hgemm_cases(dtype: torch.dtype) -> list[KernelCase]:
    return [hgemm_case(m, n, k, dtype) for n, k in LLAMA_SHAPES.values() for m in TOKENS]


register("hgemm", hgemm_cases)
