"""Shared test oracles: float64 references and the relative-error measure every kernel test uses."""

import torch


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64, with out moved to ref's device."""
    ref = ref.double()
    return ((out.double().to(ref.device) - ref).norm() / ref.norm()).item()


def linear_reference64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().t()


def fused_linear_reference64(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                             residual: torch.Tensor | None, silu_mul: bool = False,
                             round_scaled_x: bool = False) -> torch.Tensor:
    """residual + RMSNorm(x; norm_weight, eps) @ w.T in float64 (either part optional); with `silu_mul`,
    w is [gate; up] and silu(gate) * up of the product replaces it. `round_scaled_x` rounds
    norm_weight * x to x's dtype before the product, as the fused GEMV does (its one rounding step:
    without it a few outputs whose dot products cancel can miss a norm-wise bound)."""
    x64 = x.double()
    if norm_weight is not None:
        scaled = x64 * norm_weight.double()
        if round_scaled_x:
            scaled = scaled.to(x.dtype).double()
        x64 = scaled * torch.rsqrt(x64.square().mean(dim=-1, keepdim=True) + eps)
    y = x64 @ w.double().t()
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y if residual is None else y + residual.double()


def random_linear_problem(rows: int, n: int, k: int, dtype: torch.dtype, device="cuda"):
    """x [rows, K], w [N, K] scaled to unit-variance outputs, and out [rows, N] poisoned with NaN."""
    x = torch.randn(rows, k, device=device, dtype=dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    out = torch.full((rows, n), float("nan"), device=device, dtype=dtype)
    return x, w, out
