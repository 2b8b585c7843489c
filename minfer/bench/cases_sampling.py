"""Token selection over the Llama-2 / Llama-3 vocabularies: our argmax against torch.argmax, and the
cost of top-k sampling, which stays in torch (minfer.sampling) unless this case shows it matters.

Logits of one decode step are a few hundred KB and were just written by the lm_head GEMV, so these
cases run from L2 on purpose: that is where the engine finds them.
"""

from __future__ import annotations

import torch

from .. import ops
from ..sampling import SamplingParams, sample
from .kernel_suite import KernelCase, register

VOCABS = (32000, 128256)
TOP_K = SamplingParams(temperature=0.8, top_k=50)


def logits_copies(copies: int, vocab: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [(torch.randn(1, vocab, device="cuda") * 4).to(dtype) for _ in range(copies)]


def argmax_case(vocab: int, dtype: torch.dtype) -> KernelCase:
    def build(copies):
        logits = logits_copies(copies, vocab, dtype)
        out = torch.empty(1, dtype=torch.int64, device="cuda")
        return (lambda i: ops.argmax(logits[i], out=out)), (lambda i: torch.argmax(logits[i], dim=-1))

    size = torch.finfo(dtype).bits // 8
    return KernelCase(op="argmax", shape=f"1x{vocab}", dtype=dtype, bytes=size * vocab + 8, flops=0, build=build,
                      baseline="torch.argmax", bound="latency")


def top_k_case(vocab: int, dtype: torch.dtype) -> KernelCase:
    """What the engine runs for top-k sampling (torch ops, no minfer kernel): no baseline to beat."""

    def build(copies):
        logits = logits_copies(copies, vocab, dtype)
        return (lambda i: sample(logits[i], TOP_K)), None

    size = torch.finfo(dtype).bits // 8
    return KernelCase(op="sample_top_k", shape=f"1x{vocab}", dtype=dtype, bytes=size * vocab + 8, flops=0,
                      build=build, baseline="—", bound="latency")


register("argmax", lambda dtype: [argmax_case(v, dtype) for v in VOCABS])
register("sample_top_k", lambda dtype: [top_k_case(v, dtype) for v in VOCABS])
