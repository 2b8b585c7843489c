"""Kronecker-sparse factor products (kernels/ksmm; docs/FORMATS.md, "Kronecker-sparse factors"): one fused
kernel per factor, reading x with the stride-d gather and writing y with the stride-d scatter, fp32 sums."""

from __future__ import annotations

import torch

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
    """The kernel ops.ksmm runs for this pattern and batch (aligned tensors): gemv, else tensor-core, else
    generic, the first that takes it."""
    return next(path for path in ("gemv", "tensor-core", "generic") if ksmm_kernel_takes(path, pattern, tokens))


def ksmm_reference(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """x [T, a·c·d] times the (a, b, c, d) factor's matrix transposed, [T, a·b·d], in fp32 (float64 stays
    float64), rounded to x's dtype: Y[n, i, j, l] = sum_k X[n, i, k, l] W[i, j, k, l]. The views do the
    stride-d gather and scatter; the CPU path and the oracle."""
    a, b, c, d = factor.shape
    compute = torch.promote_types(x.dtype, torch.float32)
    y = torch.einsum("nikl,ijkl->nijl", x.reshape(x.shape[0], a, c, d).to(compute), factor.to(compute))
    return y.reshape(x.shape[0], a * b * d).to(x.dtype)


@fake_impl("minfer::ksmm")
def _ksmm_fake(x, factor, out):
    return None


@fake_impl("minfer::ksmm_tuned")
def _ksmm_tuned_fake(x, factor, out, path):
    return None


def ksmm(x: torch.Tensor, factor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, a·b·d] = x [T, a·c·d] times the factor's matrix transposed (ksmm_reference): on a GPU
    under the minfer backend one kernel for fp16/bf16, the bandwidth path up to KSMM_ROWS_MAX_TOKENS tokens
    and the tensor cores past them (kernels/ksmm/ksmm.h); the reference otherwise."""
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
