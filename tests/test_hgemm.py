"""Prefill HGEMM: every path and tile (sm80 mma.sync, sm90 wgmma + TMA) against a float64 reference."""

import pytest
import torch

from minfer import ops
from minfer.errors import FormatError
from tests.conftest import requires_cuda
from tests.numerics import linear_reference64, random_linear_problem, rel_error

pytestmark = pytest.mark.memcheck  # scripts/device_check.sh: compute-sanitizer memcheck runs this file

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}  # about 4x the rounding of the output dtype
SM80_KERNELS = ["sm80", "sm80_64x128", "sm80_128x128"]
SM90_KERNELS = ["sm90", "sm90_128x64", "sm90_128x128", "sm90_128x192", "sm90_128x256",
                "sm90_128x128_c2", "sm90_128x192_c2", "sm90_128x256_c2"]
# (M, N, K): M off every tile edge (1, 7, 77, 130, 513); N off the 64/128/192/256-wide tiles;
# K with a partial last 64-wide k-block (72, 520, 4104) or a single one (8).
SHAPES = [(1, 64, 64), (7, 136, 72), (77, 264, 520), (130, 200, 8), (513, 384, 136), (300, 1032, 4104)]
# More tiles than SMs, so each persistent CTA walks several tiles and reuses its pipeline.
LARGE_SHAPES = [(1000, 8192, 512), (2049, 4096, 264)]


def shape_id(shape) -> str:
    return "m{}_n{}_k{}".format(*shape)


def gpu_kernels() -> list[str]:
    """Every kernel this GPU runs: the sm90 ones on sm_90 parts only."""
    if not torch.cuda.is_available():
        return []
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    return ["auto", *SM80_KERNELS, *(SM90_KERNELS if sm90 else [])]


def test_cpu_path_matches_float64_and_keeps_leading_dims():
    x = torch.randn(2, 3, 40)
    w = torch.randn(13, 40)  # the reference takes any N; the kernels need multiples of 8
    out = ops.hgemm(x, w)
    assert out.shape == (2, 3, 13)
    assert rel_error(out, linear_reference64(x, w)) < 1e-6


def test_rejects_mismatched_k_and_unknown_kernel():
    with pytest.raises(FormatError, match="w \\[N, 16\\]"):
        ops.hgemm(torch.randn(3, 16), torch.randn(8, 15))
    with pytest.raises(FormatError, match="unknown hgemm kernel"):
        ops.hgemm_tuned(torch.randn(3, 16), torch.randn(8, 16), kernel="sm70")


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kernel", gpu_kernels())
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[shape_id(s) for s in SHAPES])
def test_hgemm_matches_float64(m, n, k, kernel, dtype):
    x, w, out = random_linear_problem(m, n, k, dtype)
    ops.hgemm_tuned(x, w, out=out, kernel=kernel)
    assert not out.isnan().any(), "some outputs were never written"
    assert rel_error(out, linear_reference64(x, w)) < TOLERANCE[dtype]


@requires_cuda
@pytest.mark.parametrize("kernel", gpu_kernels())
@pytest.mark.parametrize("m,n,k", LARGE_SHAPES, ids=[shape_id(s) for s in LARGE_SHAPES])
@pytest.mark.memcheck_skip
def test_hgemm_many_tiles_per_sm(m, n, k, kernel):
    x, w, out = random_linear_problem(m, n, k, torch.float16)
    ops.hgemm_tuned(x, w, out=out, kernel=kernel)
    assert not out.isnan().any(), "some outputs were never written"
    assert rel_error(out, linear_reference64(x, w)) < TOLERANCE[torch.float16]


@requires_cuda
def test_hgemm_leaves_memory_past_out_alone():
    """Edge tiles are clipped: the rows and columns around an output view keep their values."""
    m, n, k = 70, 72, 128
    x, w, _ = random_linear_problem(m, n, k, torch.float16)
    canvas = torch.full((m + 1, n), -7.0, device="cuda", dtype=torch.float16)
    for kernel in gpu_kernels():
        canvas.fill_(-7.0)
        ops.hgemm_tuned(x, w, out=canvas[:m], kernel=kernel)
        assert (canvas[m] == -7.0).all(), kernel
        assert rel_error(canvas[:m], linear_reference64(x, w)) < TOLERANCE[torch.float16], kernel


@requires_cuda
def test_hgemm_unaligned_views_and_3d_input():
    """The wrapper copies operands that do not start on 16 bytes; leading dims are kept."""
    dtype = torch.float16
    m, n, k = 6, 40, 64
    w = (torch.randn(n * k + 1, device="cuda") / k**0.5).to(dtype)[1:].view(n, k)
    x = torch.randn(m * k + 1, device="cuda", dtype=dtype)[1:].view(2, 3, k)
    out = torch.full((m * n + 1,), float("nan"), device="cuda", dtype=dtype)[1:].view(2, 3, n)
    ops.hgemm(x, w, out=out)
    assert rel_error(out, linear_reference64(x, w)) < TOLERANCE[dtype]


@requires_cuda
@pytest.mark.racecheck
def test_hgemm_in_cuda_graph():
    """Captured once, replayed on fresh inputs: no host sync or allocation inside the op."""
    dtype = torch.float16
    x, w, out = random_linear_problem(333, 1024, 512, dtype)
    for kernel in gpu_kernels():
        ops.hgemm_tuned(x, w, out=out, kernel=kernel)  # eager run: build, shared-memory opt-in
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ops.hgemm_tuned(x, w, out=out, kernel=kernel)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert rel_error(out, linear_reference64(x, w)) < TOLERANCE[dtype], kernel


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.memcheck_skip
def test_hgemm_opcheck(dtype):
    x, w, out = random_linear_problem(33, 64, 96, dtype)
    torch.library.opcheck(torch.ops.minfer.hgemm.default, (x, w, out))
    torch.library.opcheck(torch.ops.minfer.hgemm_tuned.default, (x, w, out, "sm80"))


@requires_cuda
def test_hgemm_rejects_bad_shapes_and_dtypes():
    x, w, out = random_linear_problem(4, 12, 32, torch.float16)
    with pytest.raises(FormatError, match="multiples of 8"):
        ops.hgemm(x, w, out=out)
    with pytest.raises(RuntimeError, match="multiples of 8"):
        torch.ops.minfer.hgemm(x, w, out)
    x, w, out = random_linear_problem(4, 16, 32, torch.float32)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        ops.hgemm(x, w, out=out)
    if torch.cuda.get_device_capability() != (9, 0):
        x, w, out = random_linear_problem(4, 16, 32, torch.float16)
        with pytest.raises(RuntimeError, match="sm90 HGEMM path needs"):
            ops.hgemm_tuned(x, w, out=out, kernel="sm90")
