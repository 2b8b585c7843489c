"""The GEMV with its input prologue fused (add + RMSNorm, SiLU-mul) against float64 references,
and the model paths that use it."""

import pytest
import torch
import torch.nn.functional as F

from minfer import ops
from minfer.errors import FormatError
from tests.conftest import requires_cuda
from tests.numerics import linear_reference64, rel_error

DTYPES = [torch.float16, torch.bfloat16]
TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 1.5e-2}  # the norm's or SiLU's rounding, then the GEMV's
# (N, K): every default launch configuration (K >= 8192: 16 warps; > 8 tiles per SM: unroll 8),
# N off the 16-row tile, K with a partial last 32-wide step and more chunks than one staging batch.
SHAPES = [(24, 8), (77, 1000), (4099, 264), (300, 4104), (4096, 11008), (16901, 264)]
EPS = 1e-5


def norm_reference64(stream: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """HF RMSNorm in float64 on the already-rounded stream, rounded to the dtype where HF rounds."""
    normed = (stream.double() * torch.rsqrt(stream.double().square().mean(-1, keepdim=True) + EPS)).to(stream.dtype)
    return weight.double() * normed.double()


def add_norm_problem(tokens: int, n: int, k: int, dtype: torch.dtype, device="cuda"):
    x = torch.randn(tokens, k, device=device, dtype=dtype)
    residual = torch.randn(tokens, k, device=device, dtype=dtype)
    norm_weight = (1 + 0.1 * torch.randn(k, device=device)).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    return x, residual, norm_weight, w


def test_cpu_paths_match_the_unfused_ops():
    x, residual, norm_weight, w = add_norm_problem(2, 24, 40, torch.float32, device="cpu")
    out, stream = ops.gemv_add_rms_norm(x, residual, norm_weight, EPS, w)
    assert torch.equal(stream, residual + x)
    assert rel_error(out, linear_reference64(norm_reference64(stream, norm_weight), w)) < 1e-6
    gate_up = torch.randn(2, 80)
    assert torch.allclose(ops.gemv_silu_mul(gate_up, w), ops.silu_mul(gate_up) @ w.t(), atol=1e-5)


def test_rejects_mismatched_shapes():
    x, residual, norm_weight, w = add_norm_problem(1, 8, 16, torch.float32, device="cpu")
    with pytest.raises(FormatError, match="residual"):
        ops.gemv_add_rms_norm(x, residual[:, :8], norm_weight, EPS, w)
    with pytest.raises(FormatError, match="gate_up"):
        ops.gemv_silu_mul(torch.randn(1, 30), w)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_add_rms_norm_matches_float64(n, k, tokens, dtype):
    x, residual, norm_weight, w = add_norm_problem(tokens, n, k, dtype)
    before = residual.clone()
    residual_out = torch.full_like(residual, float("nan"))
    out = torch.full((tokens, n), float("nan"), device="cuda", dtype=dtype)
    ops.gemv_add_rms_norm(x, residual, norm_weight, EPS, w, residual_out=residual_out, out=out)
    assert torch.equal(residual, before), "the input residual must be left as it is"
    assert torch.equal(residual_out, residual + x), "residual_out is the dtype-rounded sum"
    expected = linear_reference64(norm_reference64(residual + x, norm_weight), w)
    assert rel_error(out, expected) < TOLERANCE[dtype]


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_silu_mul_matches_float64(n, k, tokens, dtype):
    gate_up = torch.randn(tokens, 2 * k, device="cuda", dtype=dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    out = torch.full((tokens, n), float("nan"), device="cuda", dtype=dtype)
    ops.gemv_silu_mul(gate_up, w, out=out)
    gate, up = gate_up.double().chunk(2, dim=-1)
    expected = linear_reference64((F.silu(gate) * up).to(dtype), w)
    assert rel_error(out, expected) < TOLERANCE[dtype]


@requires_cuda
def test_kernel_rejects_what_it_cannot_stage():
    """K % 8 != 0, an overlapping residual_out, and a staged x beyond shared memory are errors of the
    op; DenseWeight checks `gemv_fuses` first and runs the unfused ops instead."""
    x, residual, norm_weight, w = add_norm_problem(1, 16, 12, torch.float16)
    with pytest.raises(RuntimeError, match="K % 8 == 0"):
        torch.ops.minfer.gemv_add_rms_norm(x, residual, norm_weight, EPS, w, torch.empty_like(x),
                                           torch.empty(1, 16, device="cuda", dtype=torch.float16))
    x, residual, norm_weight, w = add_norm_problem(1, 16, 64, torch.float16)
    with pytest.raises(RuntimeError, match="must not overlap"):
        torch.ops.minfer.gemv_add_rms_norm(x, residual, norm_weight, EPS, w, residual,
                                           torch.empty(1, 16, device="cuda", dtype=torch.float16))
    big = torch.randn(8, 2 * 65536, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="shared memory"):
        torch.ops.minfer.gemv_silu_mul(big, torch.randn(16, 65536, device="cuda", dtype=torch.float16),
                                       torch.empty(8, 16, device="cuda", dtype=torch.float16))


@requires_cuda
def test_unfused_fallback():
    """A format input the fused kernel cannot take (here: too many tokens to stage) gives None, and
    the Linear then runs the add-norm and the GEMV separately, with the same result."""
    from minfer.formats import DenseWeight
    from minfer.model import Linear, RMSNorm

    tokens, n, k = 8, 64, 11008
    gate_up = torch.randn(tokens, 2 * k, device="cuda", dtype=torch.float16)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.float16)
    assert DenseWeight(w).fused_silu_mul(gate_up) is None
    linear = Linear(k, n)
    linear.set_format(DenseWeight(w))
    expected = linear_reference64(ops.silu_mul(gate_up), w)
    assert rel_error(linear.forward_silu_mul(gate_up), expected) < TOLERANCE[torch.float16]

    x, residual, norm_weight, w = add_norm_problem(1, 40, 64, torch.float16)
    norm = RMSNorm(64, EPS)
    norm.weight = norm_weight
    linear = Linear(64, 40)
    linear.set_format(DenseWeight(w))
    fused_out, fused_stream = linear.forward_add_rms_norm(x, residual.clone(), norm)
    unfused = residual.clone()
    unfused_out = linear(norm.add_forward(unfused, x))
    assert torch.equal(fused_stream, unfused)
    assert rel_error(fused_out, unfused_out.double()) < TOLERANCE[torch.float16]


@requires_cuda
def test_fused_chain_in_cuda_graph():
    """add-norm GEMV -> SiLU GEMV -> add-norm GEMV, each reading what the one before wrote (the PDL
    wait), captured once and replayed on fresh inputs."""
    dtype, hidden, inter = torch.float16, 512, 1376
    x, residual, norm_weight, w_gate_up = add_norm_problem(1, 2 * inter, hidden, dtype)
    w_down = (torch.randn(hidden, inter, device="cuda") / inter**0.5).to(dtype)
    w_out = (torch.randn(300, hidden, device="cuda") / hidden**0.5).to(dtype)

    def step():
        gate_up, stream = ops.gemv_add_rms_norm(x, residual, norm_weight, EPS, w_gate_up)
        down = ops.gemv_silu_mul(gate_up, w_down)
        return ops.gemv_add_rms_norm(down, stream, norm_weight, EPS, w_out)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, stream = step()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        residual.copy_(torch.randn_like(residual))
        graph.replay()
        torch.cuda.synchronize()
        first = residual + x
        gate_up = linear_reference64(norm_reference64(first, norm_weight), w_gate_up).to(dtype)
        down = linear_reference64(ops.silu_mul(gate_up), w_down).to(dtype)
        expected = linear_reference64(norm_reference64(first + down, norm_weight), w_out)
        assert rel_error(out, expected) < 3 * TOLERANCE[dtype]


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_opcheck(dtype):
    x, residual, norm_weight, w = add_norm_problem(2, 48, 96, dtype)
    out = torch.empty(2, 48, device="cuda", dtype=dtype)
    torch.library.opcheck(torch.ops.minfer.gemv_add_rms_norm.default,
                          (x, residual, norm_weight, EPS, w, torch.empty_like(x), out))
    gate_up = torch.randn(2, 192, device="cuda", dtype=dtype)
    torch.library.opcheck(torch.ops.minfer.gemv_silu_mul.default, (gate_up, w, out))
