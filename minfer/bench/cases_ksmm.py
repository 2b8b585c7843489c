"""KS factor cases for the kernel suite and apps/profile.py --op ksmm: the factors of Llama-2-7B's monarch-50
chains at 1 and 4096 tokens, against the bmm formulation (minfer.bench.ksmm_suite times the whole grid
against every baseline)."""

from __future__ import annotations

import torch

from .. import ops
from ..sparsity.factorize import monarch_chain
from .kernel_suite import KernelCase, register
from .ksmm_suite import LLAMA2_7B_PROJECTIONS, bmm_operands, bmm_product

TOKEN_COUNTS = (1, 4096)


def ksmm_case(pattern, tokens: int, dtype: torch.dtype) -> KernelCase:
    a, b, c, d = pattern

    def build(copies):
        factors = [(torch.randn(pattern, device="cuda") / c**0.5).to(dtype) for _ in range(copies)]
        operands = [bmm_operands(f) for f in factors]
        x = torch.randn(tokens, a * c * d, device="cuda").to(dtype)
        out = torch.empty(tokens, a * b * d, device="cuda", dtype=dtype)
        return (lambda i: ops.ksmm(x, factors[i], out)), (lambda i: bmm_product(x, operands[i], pattern))

    size = torch.finfo(dtype).bits // 8
    return KernelCase(op="ksmm", shape=f"{a},{b},{c},{d} t{tokens}", dtype=dtype,
                      bytes=size * (a * b * c * d + tokens * a * (b + c) * d), flops=2 * tokens * a * b * c * d,
                      build=build, baseline="bmm + permutations", bound="memory" if tokens <= 16 else "compute")


def ksmm_cases(dtype: torch.dtype) -> list[KernelCase]:
    patterns = list(dict.fromkeys(p for shape in LLAMA2_7B_PROJECTIONS for p in monarch_chain(shape, 0.5)))
    return [ksmm_case(p, t, dtype) for t in TOKEN_COUNTS for p in patterns]


register("ksmm", ksmm_cases)
