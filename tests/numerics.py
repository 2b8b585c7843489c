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


def sparse_matrix(rows, cols, density, dtype=torch.float16, seed=0, uneven=False):
    """Random matrix with Bernoulli(density) support; `uneven` gives every row its own density."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    matrix = torch.randn(rows, cols, device="cuda", generator=generator)
    keep = density
    if uneven:
        keep = torch.rand(rows, 1, device="cuda", generator=generator) * density * 2
    matrix[torch.rand(rows, cols, device="cuda", generator=generator) >= keep] = 0
    return matrix.to(dtype)


def relative_difference(out, expected):
    return ((out.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def relative_error(out, matrix, x):
    return relative_difference(out, x.double() @ matrix.double().T)


def assert_graph_replays_read_new_inputs(product, matrix, x, out):
    """`product()` (x -> out) captured in a CUDA graph after a warm-up gives W x for new x at each replay."""
    product()  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        product()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, matrix, x) < 2e-3
