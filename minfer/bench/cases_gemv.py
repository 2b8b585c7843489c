"""GEMV cases: the Llama-2-7B / Llama-3-8B decode projections against F.linear (cuBLAS), and the
sublayer fusions decode runs (RMSNorm of x before qkv / gate_up / lm_head, silu(gate) * up after
gate_up, the residual add after o / down) against the same steps as torch ops."""

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


# (N, K, fusion) of one decode token: the projections after a norm, and those adding into the residual.
FUSED_SHAPES = [(12288, 4096, "norm"), (22016, 4096, "norm+silu_mul"), (32000, 4096, "norm"), (4096, 4096, "add"),
                (4096, 11008, "add")]
NORM_EPS = 1e-5


FUSION_BASELINES = {"norm": "rms_norm + F.linear", "norm+silu_mul": "rms_norm + F.linear + silu * up",
                    "add": "F.linear + add_"}


def torch_fused_projection(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, fused: dict) -> torch.Tensor:
    """The torch steps a fused decode projection (`fused_inputs`) replaces: the product added into
    `out`, or RMSNorm of x, the product and silu(gate) * up."""
    if fused.get("accumulate"):
        return out.add_(F.linear(x, weight))
    y = F.linear(F.rms_norm(x, (x.shape[-1],), fused["norm_weight"], NORM_EPS), weight)
    if fused["silu_mul"]:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y


def fused_inputs(n: int, k: int, fusion: str, dtype: torch.dtype,
                 tokens: int = 1) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The tokens' x, the output (the residual, zero, for "add") and the keyword arguments that fuse
    `fusion` into ops.gemv or ops.macko_spmv (the norm weight g is under "norm_weight")."""
    x = torch.randn(tokens, k, device="cuda", dtype=dtype)
    out = torch.zeros(tokens, n // 2 if fusion.endswith("silu_mul") else n, device="cuda", dtype=dtype)
    if fusion == "add":
        return x, out, {"accumulate": True}
    g = (1.0 + 0.1 * torch.randn(k, device="cuda")).to(dtype)
    return x, out, {"norm_weight": g, "eps": NORM_EPS, "silu_mul": fusion.endswith("silu_mul")}


def fused_io_bytes(n: int, k: int, fusion: str, size: int, tokens: int = 1) -> int:
    """Bytes of the tokens' fused projection besides the weights: x, y, and the norm weight or the
    residual read before it is written."""
    outputs = n // 2 if fusion.endswith("silu_mul") else n
    return size * (tokens * (k + outputs) + (k if fusion.startswith("norm") else tokens * n))


def fused_gemv_case(n: int, k: int, fusion: str, dtype: torch.dtype) -> KernelCase:
    def build(copies):
        weights = [(torch.randn(n, k, device="cuda") / k**0.5).to(dtype) for _ in range(copies)]
        x, out, fused = fused_inputs(n, k, fusion, dtype)
        return ((lambda i: ops.gemv(x, weights[i], out=out, **fused)),
                (lambda i: torch_fused_projection(x, weights[i], out, fused)))

    size = torch.finfo(dtype).bits // 8
    return KernelCase(op="gemv_fused", shape=f"{n}x{k} +{fusion}", dtype=dtype,
                      bytes=size * n * k + fused_io_bytes(n, k, fusion, size), flops=2 * n * k, build=build,
                      baseline=FUSION_BASELINES[fusion])


register("gemv", gemv_cases)
register("gemv_fused", lambda dtype: [fused_gemv_case(n, k, fusion, dtype) for n, k, fusion in FUSED_SHAPES])
