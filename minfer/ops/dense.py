"""Dense projections (kernels/dense): the decode GEMV and the prefill HGEMM, with their reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import FormatError
from .elementwise import silu_mul as silu_mul_op
from .runtime import fake_impl, use_kernels

GEMV_MAX_TOKENS = 8  # kernels/dense/gemv.h, kGemvMaxTokens: the tokens are the n = 8 side of the tensor-core tile
HGEMM_KERNELS = ("auto", "sm80", "sm80_64x128", "sm80_128x128",
                 "sm90", "sm90_128x64", "sm90_128x128", "sm90_128x192", "sm90_128x256",
                 "sm90_128x128_c2", "sm90_128x192_c2", "sm90_128x256_c2")  # kernels/dense/hgemm.cu, kKernels


def linear_reference(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                     residual: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x @ w.T with fp32 accumulation, in x's dtype: the oracle of gemv and hgemm.

    With `norm_weight` g, of RMSNorm(x) = g * x * rsqrt(mean(x^2) + eps) as the fused kernels compute
    it: g * x rounded to the dtype, the per-token scale applied to the fp32 product. With `residual`,
    residual + that, rounded once (the fused residual add). With `silu_mul`, w is [gate; up] and the
    result silu(gate) * up of the fp32 products, rounded once."""
    if norm_weight is None:
        y = x.float() @ w.float().t()
    else:
        scale = torch.rsqrt(x.float().square().mean(dim=-1, keepdim=True) + eps)
        y = ((x * norm_weight).float() @ w.float().t()) * scale
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


@fake_impl("minfer::gemv")
def _gemv_fake(x, w, out, norm_weight=None, eps=0.0, accumulate=False, silu_mul=False):
    return None


@fake_impl("minfer::gemv_tuned")
def _gemv_tuned_fake(x, w, out, norm_weight, eps, accumulate, silu_mul, warps_per_block, unroll):
    return None


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0, accumulate: bool = False,
         silu_mul: bool = False) -> torch.Tensor:
    """x @ w.T for decode: x [..., K] holding 1..8 tokens in all, w [N, K] -> [..., N], fp32 accumulation.

    Fusions of a Llama sublayer, so decode needs no norm or add kernel: `norm_weight` [K] multiplies
    RMSNorm(x) (eps as in the model) instead of x; `accumulate` adds the product into `out` in place
    (the residual stream) instead of overwriting it; `silu_mul` takes w as the MLP's [gate; up] [2I, K]
    and returns silu(gate) * up [..., I] (in the kernel's epilogue when a norm is fused too, as in the
    MLP; otherwise through the silu_mul kernel)."""
    return _gemv(x, w, out, norm_weight, eps, accumulate, silu_mul, None)


def gemv_tuned(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
               norm_weight: torch.Tensor | None = None, eps: float = 0.0, accumulate: bool = False,
               silu_mul: bool = False, warps_per_block: int = 0, unroll: int = 0) -> torch.Tensor:
    """gemv with the kernel's launch configuration pinned: `warps_per_block` (4, 8, 16) and `unroll`
    (2, 4, 8; 0: the measured default for the shape). `minfer.bench.gemv_sweep` times them."""
    return _gemv(x, w, out, norm_weight, eps, accumulate, silu_mul, (warps_per_block, unroll))


def _gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
          accumulate: bool, silu_mul: bool, tuning: tuple[int, int] | None) -> torch.Tensor:
    k = x.shape[-1]
    if w.dim() != 2 or w.shape[1] != k:
        raise FormatError(f"gemv needs w [N, {k}] for x [..., {k}], got w {tuple(w.shape)}")
    tokens = x.numel() // max(k, 1)
    if not 1 <= tokens <= GEMV_MAX_TOKENS:
        raise FormatError(f"gemv takes 1..{GEMV_MAX_TOKENS} tokens, got {tokens}; use a GEMM (hgemm, F.linear) for more")
    if accumulate and out is None:
        raise FormatError("gemv(accumulate=True) adds into `out`: pass the tensor to add into")
    if silu_mul and (w.shape[0] % 2 or accumulate):
        raise FormatError(f"gemv(silu_mul=True) needs w = [gate; up] with an even N (got {w.shape[0]}) and no accumulate")
    outputs = w.shape[0] // 2 if silu_mul else w.shape[0]
    if out is None:
        out = x.new_empty(*x.shape[:-1], outputs)
    elif out.shape[-1] != outputs or out.numel() != tokens * outputs:
        raise FormatError(f"gemv: out must be [..., {outputs}] for {tokens} tokens, got {tuple(out.shape)}")
    if use_kernels(x) and silu_mul and norm_weight is None:  # the kernel fuses silu only after a norm
        gate_up = _gemv(x.reshape(tokens, k), w, None, None, 0.0, False, False, tuning)
        silu_mul_op(gate_up, out.view(tokens, outputs))
    elif use_kernels(x):
        args = (x.reshape(tokens, k), w, out.view(tokens, outputs), norm_weight, eps, accumulate, silu_mul)
        if tuning is None:
            torch.ops.minfer.gemv(*args)
        else:
            torch.ops.minfer.gemv_tuned(*args, *tuning)
    else:
        out.copy_(linear_reference(x, w, norm_weight, eps, out if accumulate else None, silu_mul))
    return out


@fake_impl("minfer::hgemm")
def _hgemm_fake(x, w, out):
    return None


@fake_impl("minfer::hgemm_tuned")
def _hgemm_tuned_fake(x, w, out, kernel):
    return None


def hgemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T for prefill: x [..., K], w [N, K] (HF layout) -> [..., N], fp32 accumulation; wgmma + TMA
    on sm_90a and mma.sync elsewhere."""
    return _hgemm(x, w, out, None)


def hgemm_tuned(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *, kernel: str) -> torch.Tensor:
    """hgemm with the path and tile pinned by name (HGEMM_KERNELS; kernels/dense/hgemm.h), for tests and
    benchmarks; "auto" chooses as hgemm does."""
    if kernel not in HGEMM_KERNELS:
        raise FormatError(f"unknown hgemm kernel {kernel!r}; choose one of {HGEMM_KERNELS}")
    return _hgemm(x, w, out, kernel)


def _hgemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, kernel: str | None) -> torch.Tensor:
    k = x.shape[-1]
    if w.dim() != 2 or w.shape[1] != k:
        raise FormatError(f"hgemm needs w [N, {k}] for x [..., {k}], got w {tuple(w.shape)}")
    n = w.shape[0]
    if out is None:
        out = x.new_empty(*x.shape[:-1], n)
    if use_kernels(x):
        if n % 8 or k % 8:
            raise FormatError(f"hgemm needs N and K to be multiples of 8, got N={n}, K={k}; pad the weight with zeros")
        dst = out if _rows_aligned(out) else torch.empty(out.shape, dtype=out.dtype, device=out.device)
        args = (_aligned_copy(x.reshape(-1, k)), _aligned_copy(w), dst.view(-1, n))
        if kernel is None:
            torch.ops.minfer.hgemm(*args)
        else:
            torch.ops.minfer.hgemm_tuned(*args, kernel)
        if dst is not out:
            out.copy_(dst)
    else:
        out.copy_(linear_reference(x, w))
    return out


def _rows_aligned(t: torch.Tensor) -> bool:
    """The HGEMM kernels move 16-byte pieces of contiguous rows."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def _aligned_copy(t: torch.Tensor) -> torch.Tensor:
    return t if _rows_aligned(t) else t.clone(memory_format=torch.contiguous_format)
