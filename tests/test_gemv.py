"""Decode GEMV: the tensor-core kernel (and its scalar fallback) against a float64 reference."""

import pytest
import torch

from minfer import ops
from minfer.errors import FormatError
from tests.conftest import requires_cuda
from tests.numerics import fused_linear_reference64, linear_reference64, random_linear_problem, rel_error

pytestmark = pytest.mark.memcheck  # scripts/device_check.sh: compute-sanitizer memcheck runs this file

DTYPES = [torch.float16, torch.bfloat16]
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}  # about 4x the rounding of the output dtype
# (N, K): N off the 16-row tile; K with a partial last 32-wide step, leftover steps, uneven batches
# per warp; each launch configuration (K >= 8192: 16 warps; at least 4 tiles per SM on a 132-SM GPU:
# unroll 8); K % 8 != 0 runs the scalar fallback.
SHAPES = [(1, 8), (5, 40), (77, 1000), (129, 4096), (300, 4104), (4099, 264), (4096, 11008), (16901, 264),
          (16901, 4104), (33, 1001), (7, 13)]


def test_cpu_path_keeps_leading_dims():
    x = torch.randn(2, 1, 40)
    w = torch.randn(24, 40)
    out = ops.gemv(x, w)
    assert out.shape == (2, 1, 24)
    assert rel_error(out, linear_reference64(x, w)) < 1e-6


def test_rejects_more_than_eight_tokens_and_mismatched_k():
    with pytest.raises(FormatError, match="1..8 tokens"):
        ops.gemv(torch.randn(9, 16), torch.randn(4, 16))
    with pytest.raises(FormatError, match="w \\[N, 16\\]"):
        ops.gemv(torch.randn(1, 16), torch.randn(4, 15))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", range(1, 9))
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_matches_float64(n, k, tokens, dtype):
    x, w, out = random_linear_problem(tokens, n, k, dtype)
    ops.gemv(x, w, out=out)
    assert not out.isnan().any(), "some outputs were never written"
    assert rel_error(out, linear_reference64(x, w)) < TOLERANCE[dtype]


@requires_cuda
@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("warps,unroll", [(w, u) for w in (4, 8, 16) for u in (2, 4, 8) if (w, u) != (16, 8)])
@pytest.mark.parametrize("n,k", [(77, 1000), (300, 4104)])
@pytest.mark.memcheck_skip
def test_every_launch_configuration(n, k, warps, unroll, tokens):
    """Every (warps, unroll) variant that gemv_sweep times matches float64."""
    dtype = torch.float16
    x, w, out = random_linear_problem(tokens, n, k, dtype)
    ops.gemv_tuned(x, w, out=out, warps_per_block=warps, unroll=unroll)
    assert rel_error(out, linear_reference64(x, w)) < TOLERANCE[dtype]


@requires_cuda
def test_rejects_unknown_launch_configuration():
    x, w, out = random_linear_problem(1, 16, 32, torch.float16)
    with pytest.raises(RuntimeError, match="warps_per_block must be"):
        ops.gemv_tuned(x, w, out=out, warps_per_block=6)
    with pytest.raises(RuntimeError, match="unroll must be"):
        ops.gemv_tuned(x, w, out=out, unroll=3)
    with pytest.raises(RuntimeError, match="unroll must be"):  # 16 warps x 8 steps would spill
        ops.gemv_tuned(x, w, out=out, warps_per_block=16, unroll=8)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_unaligned_views(dtype):
    """Rows that do not start on 16 bytes (an offset view) take the scalar path and stay correct."""
    n, k, tokens = 40, 64, 3
    w = (torch.randn(n * k + 1, device="cuda") / k**0.5).to(dtype)[1:].view(n, k)
    x = torch.randn(tokens * k + 1, device="cuda", dtype=dtype)[1:].view(tokens, k)
    out = torch.full((tokens, n), float("nan"), device="cuda", dtype=dtype)
    ops.gemv(x, w, out=out)
    assert rel_error(out, linear_reference64(x, w)) < TOLERANCE[dtype]


@requires_cuda
@pytest.mark.racecheck
def test_gemv_chain_in_cuda_graph():
    """Two dependent GEMVs captured in one graph: the second reads what the first wrote (this is what
    the programmatic-dependent-launch wait must guarantee), replayed on fresh inputs."""
    dtype = torch.float16
    x, w1, h = random_linear_problem(2, 2048, 1024, dtype)
    w2 = (torch.randn(777, 2048, device="cuda") / 2048**0.5).to(dtype)
    y = torch.empty(2, 777, device="cuda", dtype=dtype)
    ops.gemv(x, w1, out=h)
    ops.gemv(h, w2, out=y)  # eager run: builds and warms up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.gemv(x, w1, out=h)
        ops.gemv(h, w2, out=y)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        h.fill_(float("nan"))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected = linear_reference64(linear_reference64(x, w1).to(dtype), w2)
        assert rel_error(y, expected) < 2 * TOLERANCE[dtype]


FUSIONS = [(True, False), (False, True), (True, True)]  # (RMSNorm of x, add into out)
FUSED_SHAPES = [(77, 1000), (129, 4096), (300, 4104), (4099, 264), (16901, 4104), (33, 1001), (7, 13)]


def fused_problem(tokens, n, k, dtype, norm, accumulate, device="cuda"):
    """x off unit scale (so the RMS scale matters), a norm weight around 1, a residual to add into."""
    x, w, out = random_linear_problem(tokens, n, k, dtype, device)
    x = (x.float() * 7.0).to(dtype)
    g = (1.0 + 0.3 * torch.randn(k, device=device)).to(dtype) if norm else None
    residual = torch.randn(tokens, n, device=device, dtype=dtype) if accumulate else None
    return x, w, g, residual if accumulate else out


@pytest.mark.parametrize("norm,accumulate", FUSIONS)
def test_cpu_fused_reference(norm, accumulate):
    x, w, g, out = fused_problem(3, 24, 40, torch.float32, norm, accumulate, device="cpu")
    expected = fused_linear_reference64(x, w, g, 1e-5, out.clone() if accumulate else None)
    ops.gemv(x, w, out=out, norm_weight=g, eps=1e-5, accumulate=accumulate)
    assert rel_error(out, expected) < 1e-6


@requires_cuda
@pytest.mark.parametrize("norm,accumulate", FUSIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("n,k", FUSED_SHAPES)
def test_fused_gemv_matches_float64(n, k, tokens, dtype, norm, accumulate):
    """RMSNorm of x (scale from the loaded x, applied in the epilogue) and the in-place residual add,
    on the tensor-core path and the scalar fallback (K % 8 != 0)."""
    x, w, g, out = fused_problem(tokens, n, k, dtype, norm, accumulate)
    expected = fused_linear_reference64(x, w, g, 1e-5, out.clone() if accumulate else None, round_scaled_x=True)
    ops.gemv(x, w, out=out, norm_weight=g, eps=1e-5, accumulate=accumulate)
    assert not out.isnan().any(), "some outputs were never written"
    assert rel_error(out, expected) < TOLERANCE[dtype]


@requires_cuda
@pytest.mark.parametrize("warps,unroll", [(w, u) for w in (4, 8, 16) for u in (2, 4, 8) if (w, u) != (16, 8)])
@pytest.mark.memcheck_skip
def test_fused_gemv_every_launch_configuration(warps, unroll):
    x, w, g, out = fused_problem(2, 300, 4104, torch.float16, True, True)
    expected = fused_linear_reference64(x, w, g, 1e-6, out.clone(), round_scaled_x=True)
    ops.gemv_tuned(x, w, out=out, norm_weight=g, eps=1e-6, accumulate=True, warps_per_block=warps, unroll=unroll)
    assert rel_error(out, expected) < TOLERANCE[torch.float16]


# (I, K) of [gate; up] matrices [2I, K]: I off the 8-row half tile, every launch shape, the scalar path
# (K of a few hundred at least: with the norm, g * x is rounded to the dtype, and bf16 needs the averaging).
# (5, 264): a partial tile of gate rows. A norm-wise error over one output is ill-conditioned when its
# gate's dot product cancels, so no shape has a single output row, and with the norm the oracle rounds
# g * x as the kernel does (bf16 at (5, 264) missed the bound by 0.2% once otherwise, H100).
SILU_SHAPES = [(5, 264), (37, 1000), (688, 4096), (300, 4104), (5504, 4096), (64, 11008), (21, 1001)]


@pytest.mark.parametrize("norm", [False, True])
def test_cpu_silu_mul_reference(norm):
    x, w, g, out = fused_problem(3, 2 * 12, 40, torch.float32, norm, False, device="cpu")
    expected = fused_linear_reference64(x, w, g, 1e-5, None, silu_mul=True)
    out = ops.gemv(x, w, norm_weight=g, eps=1e-5, silu_mul=True)
    assert out.shape == (3, 12)
    assert rel_error(out, expected) < 1e-6


@requires_cuda
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("inter,k", SILU_SHAPES)
def test_silu_mul_gemv_matches_float64(inter, k, tokens, dtype, norm):
    """The MLP's gate_up projection with silu(gate) * up in the epilogue (a tile holds gate rows
    8i..8i+7 and the matching up rows), with and without the fused RMSNorm."""
    x, w, g, _ = fused_problem(tokens, 2 * inter, k, dtype, norm, False)
    out = torch.full((tokens, inter), float("nan"), device="cuda", dtype=dtype)
    ops.gemv(x, w, out=out, norm_weight=g, eps=1e-5, silu_mul=True)
    assert not out.isnan().any(), "some outputs were never written"
    # Without the norm, gate and up are rounded to the dtype before the silu_mul kernel: twice the error.
    tolerance = TOLERANCE[dtype] * (1 if norm else 2)
    assert rel_error(out, fused_linear_reference64(x, w, g, 1e-5, None, silu_mul=True, round_scaled_x=True)) < tolerance


@requires_cuda
@pytest.mark.parametrize("warps,unroll", [(w, u) for w in (4, 8, 16) for u in (2, 4, 8) if (w, u) != (16, 8)])
@pytest.mark.memcheck_skip
def test_silu_mul_gemv_every_launch_configuration(warps, unroll):
    x, w, g, _ = fused_problem(2, 2 * 300, 4104, torch.float16, True, False)
    out = ops.gemv_tuned(x, w, norm_weight=g, eps=1e-6, silu_mul=True, warps_per_block=warps, unroll=unroll)
    expected = fused_linear_reference64(x, w, g, 1e-6, None, silu_mul=True, round_scaled_x=True)
    assert rel_error(out, expected) < TOLERANCE[torch.float16]


@requires_cuda
def test_fused_gemv_rejects_bad_arguments():
    x, w, g, out = fused_problem(1, 64, 64, torch.float16, True, False)
    with pytest.raises(FormatError, match="pass the tensor to add into"):
        ops.gemv(x, w, accumulate=True)
    with pytest.raises(RuntimeError, match="norm_weight must be"):
        ops.gemv(x, w, out=out, norm_weight=g[:32])
    with pytest.raises(RuntimeError, match="must not overlap"):
        ops.gemv(x, w, out=x, accumulate=True)
    with pytest.raises(FormatError, match="even N"):
        ops.gemv(x, w[:63], silu_mul=True)
    with pytest.raises(FormatError, match="no accumulate"):
        ops.gemv(x, w, out=out, accumulate=True, silu_mul=True)
    with pytest.raises(FormatError, match="out must be"):  # [gate; up] of 64 rows gives 32 outputs
        ops.gemv(x, w, out=out, silu_mul=True)


@requires_cuda
@pytest.mark.racecheck
def test_sublayer_chain_in_cuda_graph():
    """A decode sublayer as the model runs it: GEMV 1 adds into the residual stream in place and
    GEMV 2 reads that residual with the RMSNorm fused, in one graph (the PDL wait must order them)."""
    dtype, hidden = torch.float16, 2048
    h = torch.randn(1, 1024, device="cuda", dtype=dtype)
    w1 = (torch.randn(hidden, 1024, device="cuda") / 32).to(dtype)
    w2 = (torch.randn(3000, hidden, device="cuda") / hidden**0.5).to(dtype)
    g = (1.0 + 0.3 * torch.randn(hidden, device="cuda")).to(dtype)
    residual = torch.randn(1, hidden, device="cuda", dtype=dtype)
    y = torch.empty(1, 3000, device="cuda", dtype=dtype)

    def sublayer():
        ops.gemv(h, w1, out=residual, accumulate=True)
        ops.gemv(residual, w2, out=y, norm_weight=g, eps=1e-5)

    sublayer()  # eager run: builds and warms up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sublayer()
    for _ in range(3):
        h.copy_(torch.randn_like(h))
        start = torch.randn_like(residual)
        residual.copy_(start)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        updated = fused_linear_reference64(h, w1, None, 0.0, start)
        assert rel_error(residual, updated) < TOLERANCE[dtype]
        assert rel_error(y, fused_linear_reference64(updated.to(dtype), w2, g, 1e-5, None)) < 2 * TOLERANCE[dtype]


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.memcheck_skip
def test_gemv_opcheck(dtype):
    x, w, out = random_linear_problem(3, 48, 96, dtype)
    torch.library.opcheck(torch.ops.minfer.gemv.default, (x, w, out))
    g = torch.ones(96, device="cuda", dtype=dtype)
    torch.library.opcheck(torch.ops.minfer.gemv.default, (x, w, out, g, 1e-5, True))
    torch.library.opcheck(torch.ops.minfer.gemv_tuned.default, (x, w, out, g, 1e-5, True, False, 8, 4))


@requires_cuda
def test_gemv_rejects_float32():
    x, w, out = random_linear_problem(1, 16, 32, torch.float32)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        ops.gemv(x, w, out=out)


@requires_cuda
def test_dense_weight_decode_runs_gemv():
    """DenseWeight sends 1..8 tokens through ops.gemv (bit-identical to calling it) and more to F.linear."""
    from minfer.formats import DenseWeight

    x, w, _ = random_linear_problem(3, 300, 512, torch.float16)
    dense = DenseWeight(w)
    assert torch.equal(dense(x.view(3, 1, 512)).view(3, 300), ops.gemv(x, w))
    prefill = torch.randn(9, 512, device="cuda", dtype=torch.float16)
    assert rel_error(dense(prefill), linear_reference64(prefill, w)) < TOLERANCE[torch.float16]
