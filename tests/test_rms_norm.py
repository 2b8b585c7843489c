"""RMSNorm and the fused residual-add RMSNorm against float64, and against HF LlamaRMSNorm numerics."""

import pytest
import torch

from minfer import ops
from minfer.errors import MinferError
from tests.conftest import requires_cuda
from tests.numerics import rel_error

pytestmark = pytest.mark.memcheck  # scripts/device_check.sh: compute-sanitizer memcheck runs this file

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}  # ~4x the output rounding
EPS = 1e-5
# Against HF's rounding order only the fp32 variance sum's order differs: a rare element lands on
# the other side of a rounding boundary, at most 2 units in the last place away.
HF_MATCH = {torch.float16: 2.5e-3, torch.bfloat16: 1.6e-2, torch.float32: 1.3e-6}
# Leading dims x hidden: decode rows, odd hidden sizes (4097, 1001 take the one-element path), a
# 70B-sized row, tiny rows, and the largest row the 16-byte path holds for 2-byte types.
SHAPES = [(1, 4096), (3, 5, 4097), (2, 8192), (7, 40), (9, 1001), (4, 1000), (1, 8)]


def rms_norm64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def assert_hf_rounding(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out, ref, rtol=HF_MATCH[out.dtype], atol=1e-5)
    if out.dtype != torch.float32:  # fp32 keeps every bit of the sum order's difference
        assert (out != ref).sum() <= max(2, out.numel() // 100)


def random_inputs(shape, dtype, device):
    x = (torch.randn(shape, device=device) * 3).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], device=device)).to(dtype)
    return x, weight


def test_reference_is_hf_llama_rmsnorm():
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x, weight = random_inputs((3, 4, 96), dtype, "cpu")
        norm = modeling.LlamaRMSNorm(96, eps=EPS).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
            assert torch.equal(ops.rms_norm_reference(x, weight, EPS), norm(x))


def test_cpu_wrappers_use_the_reference():
    x, weight = random_inputs((2, 3, 64), torch.float32, "cpu")
    assert rel_error(ops.rms_norm(x, weight, EPS), rms_norm64(x, weight, EPS)) < 1e-6
    residual = torch.randn(2, 3, 64)
    total = residual + x
    out = ops.add_rms_norm(residual, x, weight, EPS)
    assert torch.equal(residual, total)
    assert rel_error(out, rms_norm64(total, weight, EPS)) < 1e-6


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_matches_float64_and_hf(shape, dtype):
    x, weight = random_inputs(shape, dtype, "cuda")
    out = torch.full_like(x, float("nan"))
    ops.rms_norm(x, weight, EPS, out=out)
    assert not out.isnan().any(), "some outputs were never written"
    assert rel_error(out, rms_norm64(x, weight, EPS)) < TOLERANCE[dtype]
    assert_hf_rounding(out, ops.rms_norm_reference(x, weight, EPS))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [pytest.param(s, marks=pytest.mark.racecheck) if s == (1, 4096) else s
                                   for s in SHAPES], ids=str)
def test_add_rms_norm_updates_residual_and_normalises_the_sum(shape, dtype):
    x, weight = random_inputs(shape, dtype, "cuda")
    residual = torch.randn(shape, device="cuda").to(dtype)
    total = residual + x  # rounded to dtype, as the model's `residual + x`
    out = torch.full_like(x, float("nan"))
    ops.add_rms_norm(residual, x, weight, EPS, out=out)
    assert torch.equal(residual, total)
    assert not out.isnan().any(), "some outputs were never written"
    assert rel_error(out, rms_norm64(total, weight, EPS)) < TOLERANCE[dtype]
    assert_hf_rounding(out, ops.rms_norm_reference(total, weight, EPS))


@requires_cuda
def test_unaligned_views_and_in_place():
    """A view starting one element into its storage takes the one-element path; out may be x."""
    rows, hidden = 5, 4096
    storage = torch.randn(rows * hidden + 1, device="cuda").half()
    x = storage[1:].view(rows, hidden)
    weight = torch.randn(hidden, device="cuda").half()
    expected = rms_norm64(x, weight, EPS)
    ops.rms_norm(x, weight, EPS, out=x)
    assert rel_error(x, expected) < TOLERANCE[torch.float16]


@requires_cuda
def test_rejects_rows_too_long():
    x = torch.randn(1, 8196, device="cuda")  # fp32 rows hold at most 8192 elements
    with pytest.raises(MinferError, match="rows of up to 8192"):
        ops.rms_norm(x, torch.ones(8196, device="cuda"), EPS)


@requires_cuda
def test_rejects_a_weight_of_another_dtype():
    x = torch.randn(2, 64, device="cuda").half()
    with pytest.raises(MinferError, match="float16 weight"):
        ops.add_rms_norm(torch.zeros_like(x), x, torch.ones(64, device="cuda"), EPS)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.memcheck_skip
def test_opcheck(dtype):
    x, weight = random_inputs((3, 264), dtype, "cuda")
    out = torch.empty_like(x)
    torch.library.opcheck(torch.ops.minfer.rms_norm.default, (x, weight, EPS, out))
    residual = torch.randn_like(x)
    torch.library.opcheck(torch.ops.minfer.add_rms_norm.default, (residual, x, weight, EPS, out))
