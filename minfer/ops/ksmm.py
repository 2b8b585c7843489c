"""Kronecker-sparse factor products (kernels/ksmm; docs/FORMATS.md, "Kronecker-sparse factors"): one fused
kernel per factor, reading x with the stride-d gather and writing y with the stride-d scatter, fp32 sums."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import FormatError
from .runtime import fake_impl, use_kernels

KSMM_ROWS_MAX_TOKENS = 16  # kernels/ksmm/ksmm.h, kKsmmRowsMaxTokens: the bandwidth paths' batch (gemv, rows)
KSMM_ROWS_MAX_D = 64  # kernels/ksmm/ksmm.h, kKsmmRowsMaxD
# kernels/ksmm/ksmm.h, KsmmPath: "auto" picks by tokens and pattern; the others force one kernel.
KSMM_PATHS = {"auto": 0, "generic": 1, "rows": 2, "tensor-core": 3, "gemv": 4}
KSMM_DTYPES = (torch.float16, torch.bfloat16)


def ksmm_kernel_takes(path: str, pattern: tuple[int, int, int, int], tokens: int) -> bool:
    """Whether the kernel `path` runs this pattern and batch, given 16-byte aligned tensors (kernels/ksmm/ksmm.h,
    KsmmPath): the fast paths read c·d runs in 16-byte chunks; "gemv" and "rows" take up to
    KSMM_ROWS_MAX_TOKENS tokens, "rows" d a power of two up to KSMM_ROWS_MAX_D, "gemv" and "tensor-core" d in
    (1, 2, 4) or a multiple of 8; "generic" (and "auto") anything."""
    _, _, c, d = pattern
    vectors = c * d % 8 == 0
    if path == "rows":
        return vectors and tokens <= KSMM_ROWS_MAX_TOKENS and d & (d - 1) == 0 and d <= KSMM_ROWS_MAX_D
    if path in ("gemv", "tensor-core"):
        return vectors and (d in (1, 2, 4) or d % 8 == 0) and (path == "tensor-core" or tokens <= KSMM_ROWS_MAX_TOKENS)
    return True


def ksmm_path(pattern: tuple[int, int, int, int], tokens: int) -> str:
    """The kernel ops.ksmm runs for this pattern and batch (aligned tensors; kernels/ksmm/ksmm.h, KsmmPath):
    the first that takes it of rows (one token only), gemv, tensor-core and generic."""
    order = ("rows", "gemv", "tensor-core", "generic") if tokens == 1 else ("gemv", "tensor-core", "generic")
    return next(path for path in order if ksmm_kernel_takes(path, pattern, tokens))


def _factor_product(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Y[n, i, j, l] = sum_k X[n, i, k, l] W[i, j, k, l] in fp32 (float64 stays float64), unrounded."""
    a, b, c, d = factor.shape
    compute = torch.promote_types(x.dtype, torch.float32)
    y = torch.einsum("nikl,ijkl->nijl", x.reshape(x.shape[0], a, c, d).to(compute), factor.to(compute))
    return y.reshape(x.shape[0], a * b * d)


def ksmm_reference(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """x [T, a·c·d] times the (a, b, c, d) factor's matrix transposed, [T, a·b·d], in fp32 (float64 stays
    float64), rounded to x's dtype: Y[n, i, j, l] = sum_k X[n, i, k, l] W[i, j, k, l]. The views do the
    stride-d gather and scatter; the CPU path and the oracle."""
    return _factor_product(x, factor).to(x.dtype)


def ksmm_gemv_reference(x: torch.Tensor, factor: torch.Tensor, norm_weight: torch.Tensor | None = None,
                        eps: float = 0.0, residual: torch.Tensor | None = None,
                        silu_mul: bool = False) -> torch.Tensor:
    """ksmm_reference with a decode projection's fusions, as ops.linear_reference computes them for a dense
    matrix: with `norm_weight` g the factor applied to g * x rounded to the dtype, times each token's
    rsqrt(mean(x^2) + eps); with `silu_mul` silu(first half) * second half of the outputs; with `residual`
    residual + that; rounded once to x's dtype."""
    if norm_weight is None:
        y = _factor_product(x, factor)
    else:
        compute = torch.promote_types(x.dtype, torch.float32)
        scale = torch.rsqrt(x.to(compute).square().mean(dim=-1, keepdim=True) + eps)
        y = _factor_product(x * norm_weight, factor) * scale
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = y + residual.to(y.dtype)
    return y.to(x.dtype)


@fake_impl("minfer::ksmm")
def _ksmm_fake(x, factor, out):
    return None


@fake_impl("minfer::ksmm_tuned")
def _ksmm_tuned_fake(x, factor, out, path):
    return None


@fake_impl("minfer::ksmm_gemv")
def _ksmm_gemv_fake(x, factor, out, norm_weight=None, eps=0.0, accumulate=False, silu_mul=False):
    return None


def ksmm_gemv_fuses(pattern: tuple[int, int, int, int], tokens: int, silu_mul: bool = False) -> bool:
    """Whether ksmm_gemv runs this factor and batch on the kernel (aligned tensors; kernels/ksmm/ksmm.h,
    ksmm_gemv_fusion_supports): 1..KSMM_ROWS_MAX_TOKENS tokens on a pattern the gemv kernel takes, and for
    silu_mul a == 1 and an even b (the [gate; up] halves are the rows j < b/2 and j >= b/2)."""
    a, b, c, _ = pattern
    return (1 <= tokens and c >= 1 and ksmm_kernel_takes("gemv", pattern, tokens)
            and (not silu_mul or (a == 1 and b % 2 == 0)))


def ksmm_gemv(x: torch.Tensor, factor: torch.Tensor, out: torch.Tensor | None = None, *,
              norm_weight: torch.Tensor | None = None, eps: float = 0.0, accumulate: bool = False,
              silu_mul: bool = False) -> torch.Tensor:
    """One factor of a decode projection with the fusions of ops.gemv (ksmm_gemv_reference): `norm_weight`
    [a·c·d] applies the factor to RMSNorm(x) (a chain's first factor); `accumulate` adds into `out` in place
    (the residual, a chain's last factor); `silu_mul` returns silu(gate) * up [T, a·b·d / 2] of the factor's
    [gate; up] outputs. On a GPU under the minfer backend the gemv kernel where ksmm_gemv_fuses (one token with
    no fusion but `accumulate`: the rows kernel, where it takes the pattern), else the reference."""
    if factor.dim() != 4 or x.dim() != 2 or x.shape[1] != factor.shape[0] * factor.shape[2] * factor.shape[3]:
        raise FormatError(f"ksmm_gemv takes x [T, a·c·d] and a 4-D (a, b, c, d) factor, got x {tuple(x.shape)} "
                          f"and factor {tuple(factor.shape)}")
    a, b, _, d = factor.shape
    tokens = x.shape[0]
    if accumulate and out is None:
        raise FormatError("ksmm_gemv(accumulate=True) adds into `out`: pass the tensor to add into")
    if silu_mul and (a * b * d % 2 or accumulate):
        raise FormatError(f"ksmm_gemv(silu_mul=True) needs [gate; up] outputs, an even a·b·d (got {a * b * d}), "
                          "and no accumulate")
    outputs = a * b * d // 2 if silu_mul else a * b * d
    if out is None:
        out = x.new_empty(tokens, outputs)
    elif out.shape != (tokens, outputs):
        raise FormatError(f"ksmm_gemv: out must be [{tokens}, {outputs}], got {tuple(out.shape)}")
    kernel = (use_kernels(x) and factor.dtype in KSMM_DTYPES
              and ksmm_gemv_fuses(tuple(factor.shape), tokens, silu_mul))
    if kernel:
        torch.ops.minfer.ksmm_gemv(x.contiguous(), factor, out, norm_weight, eps, accumulate, silu_mul)
    else:
        out.copy_(ksmm_gemv_reference(x, factor, norm_weight, eps, out if accumulate else None, silu_mul))
    return out


def ksmm(x: torch.Tensor, factor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, a·b·d] = x [T, a·c·d] times the factor's matrix transposed (ksmm_reference): on a GPU
    under the minfer backend one kernel for fp16/bf16 (ksmm_path: a bandwidth path up to KSMM_ROWS_MAX_TOKENS
    tokens, the tensor cores past them); the reference otherwise."""
    return _ksmm(x, factor, out, None)


def ksmm_tuned(x: torch.Tensor, factor: torch.Tensor, out: torch.Tensor | None = None, *,
               path: str = "auto") -> torch.Tensor:
    """ksmm with the kernel pinned (KSMM_PATHS), for tests and benchmarks; a kernel that cannot run the
    pattern or the batch refuses it with one line."""
    if path not in KSMM_PATHS:
        raise FormatError(f"unknown KS kernel path {path!r}; choose one of {', '.join(KSMM_PATHS)}")
    return _ksmm(x, factor, out, KSMM_PATHS[path])


def _ksmm(x: torch.Tensor, factor: torch.Tensor, out: torch.Tensor | None, path: int | None) -> torch.Tensor:
    if factor.dim() != 4 or x.dim() != 2 or x.shape[1] != factor.shape[0] * factor.shape[2] * factor.shape[3]:
        raise FormatError(f"ksmm takes x [T, a·c·d] and a 4-D (a, b, c, d) factor, got x {tuple(x.shape)} and "
                          f"factor {tuple(factor.shape)}")
    a, b, _, d = factor.shape
    if out is None:
        out = x.new_empty(x.shape[0], a * b * d)
    if use_kernels(x) and factor.dtype in KSMM_DTYPES:
        if path is None:
            torch.ops.minfer.ksmm(x, factor, out)
        else:
            torch.ops.minfer.ksmm_tuned(x, factor, out, path)
    else:
        out.copy_(ksmm_reference(x, factor))
    return out
