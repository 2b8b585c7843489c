"""The KS factor kernels (kernels/ksmm, ops.ksmm) against float64 at odd batch sizes, every path on every
pattern it takes, their refusals, opcheck and CUDA-graph capture of a chain (GPU only)."""

import sys

import pytest
import torch

from minfer import ops
from minfer.errors import FormatError
from minfer.formats.ksmm import KSWeight
from minfer.sparsity.factorize import monarch_chain
from tests.conftest import requires_cuda
from tests.numerics import rel_error

pytestmark = [requires_cuda, pytest.mark.memcheck]  # memcheck: see scripts/device_check.sh

# (a, b, c, d): d = 1, 2, 4, 8, 16, 64 and odd ones, a > 1, b != c, c not a multiple of the 32-wide k tile,
# and long rows over few tiles (gemv then splits a tile over a cluster of blocks).
PATTERNS = [(1, 64, 96, 4), (4, 40, 24, 1), (2, 24, 40, 2), (1, 48, 16, 16), (3, 20, 8, 8), (5, 7, 13, 8),
            (1, 17, 24, 64), (1, 130, 200, 1), (2, 10, 29, 3), (3, 9, 7, 1), (1, 32, 1024, 8), (2, 20, 512, 2)]
BATCHES = [1, 3, 17, 300]
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def problem(pattern, tokens, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    a, _, c, d = pattern
    factor = (torch.randn(pattern, generator=generator) / c**0.5).to(dtype=dtype, device="cuda")
    x = torch.randn(tokens, a * c * d, generator=generator).to(dtype=dtype, device="cuda")
    return x, factor


def expected64(x, factor):
    return ops.ksmm_reference(x.double(), factor.double())


@pytest.mark.memcheck_skip
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("path", list(ops.KSMM_PATHS))
@pytest.mark.parametrize("tokens", BATCHES)
@pytest.mark.parametrize("pattern", PATTERNS, ids=str)
def test_every_path_matches_float64(pattern, tokens, path, dtype):
    if not ops.ksmm_kernel_takes(path, pattern, tokens):
        pytest.skip(f"the {path} kernel does not take {pattern} for {tokens} tokens (test_refusals covers it)")
    x, factor = problem(pattern, tokens, dtype, seed=tokens)
    a, b, _, d = pattern
    out = torch.full((tokens, a * b * d), float("nan"), dtype=dtype, device="cuda")
    ops.ksmm_tuned(x, factor, out, path=path)
    assert rel_error(out, expected64(x, factor)) < TOLERANCE[dtype]


@pytest.mark.parametrize("pattern, tokens, path", [
    ((1, 64, 96, 4), 1, "auto"), ((1, 48, 16, 64), 5, "auto"), ((3, 20, 8, 8), 12, "auto"),
    ((2, 24, 40, 2), 40, "auto"), ((1, 48, 16, 16), 33, "auto"), ((2, 10, 29, 3), 2, "auto"),
    ((1, 48, 16, 64), 5, "rows"), ((1, 64, 96, 4), 3, "rows"), ((1, 32, 1024, 8), 1, "gemv"),
], ids=str)
def test_small_cases_under_the_sanitizer(pattern, tokens, path):
    """Every kernel once: gemv (1 and 2 token tiles, d <= 8 and d > 8, a tile over a cluster of 8 blocks), the
    tensor-core tiles, generic, rows (auto at one token)."""
    x, factor = problem(pattern, tokens, torch.float16)
    out = ops.ksmm_tuned(x, factor, path=path)
    assert rel_error(out, expected64(x, factor)) < TOLERANCE[torch.float16]


@pytest.mark.racecheck
@pytest.mark.parametrize("pattern, tokens, path", [
    ((1, 16, 1024, 8), 3, "rows"), ((1, 40, 512, 4), 12, "gemv"), ((2, 40, 72, 4), 70, "tensor-core"),
    ((1, 40, 72, 1), 70, "tensor-core"),
], ids=str)
def test_shared_memory_kernels(pattern, tokens, path):
    """Racecheck cases: the cross-warp sums of rows (a block per row) and gemv (8 warps), the tensor-core stages."""
    x, factor = problem(pattern, tokens, torch.bfloat16)
    out = ops.ksmm_tuned(x, factor, path=path)
    assert rel_error(out, expected64(x, factor)) < TOLERANCE[torch.bfloat16]


@pytest.mark.memcheck_skip
@pytest.mark.parametrize("pattern", [(4, 300, 72, 1), (4, 200, 40, 2), (2, 200, 36, 4), (1, 100, 24, 16)],
                         ids=str)
def test_tensor_core_large_tiles(pattern):
    """Enough tokens and outputs for the large tiles on an H200 (the grid's B = 4096 shapes), with partial
    tiles in every dimension."""
    x, factor = problem(pattern, 2000, torch.float16)
    out = ops.ksmm_tuned(x, factor, path="tensor-core")
    assert rel_error(out, expected64(x, factor)) < TOLERANCE[torch.float16]


@pytest.mark.memcheck_skip
def test_refusals():
    x, factor = problem((1, 8, 8, 2), 17, torch.float16)
    for path, number in (("rows", 2), ("gemv", 4)):
        with pytest.raises(RuntimeError, match=f"path {number} cannot run the pattern"):
            ops.ksmm_tuned(x, factor, path=path)
    x, factor = problem((2, 10, 29, 3), 4, torch.float16)
    with pytest.raises(RuntimeError, match="path 3 cannot run the pattern"):
        ops.ksmm_tuned(x, factor, path="tensor-core")
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.minfer.ksmm(x[:, 1:].contiguous(), factor, x.new_empty(4, 60))
    x, factor = problem((1, 8, 16, 4), 4, torch.float16)
    misaligned = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")[1:].view_as(x).copy_(x)
    assert rel_error(ops.ksmm(misaligned, factor), expected64(x, factor)) < TOLERANCE[torch.float16]  # generic
    assert ops.ksmm_tuned(x, factor, path="gemv").shape == (4, 32)
    with pytest.raises(RuntimeError, match="path 4 cannot run"):
        ops.ksmm_tuned(misaligned, factor, path="gemv")


@pytest.mark.memcheck_skip
def test_opcheck():
    x, factor = problem((1, 64, 96, 4), 3, torch.float16)
    out = x.new_empty(3, 256)
    torch.library.opcheck(torch.ops.minfer.ksmm, (x, factor, out))
    for name, path in ops.KSMM_PATHS.items():
        if ops.ksmm_kernel_takes(name, (1, 64, 96, 4), 3):
            torch.library.opcheck(torch.ops.minfer.ksmm_tuned, (x, factor, out, path))


@pytest.mark.parametrize("tokens", [1, 300])
def test_chain_forward_runs_the_kernel_and_graph_replays_read_new_inputs(tokens):
    patterns = monarch_chain((352, 128), 0.5)  # non-square: 128 -> 352
    generator = torch.Generator().manual_seed(3)
    chain = KSWeight.from_factors([(torch.randn(p, generator=generator) / p[2] ** 0.5).half().cuda()
                                   for p in patterns])
    dense = chain.to_dense()
    x = torch.randn(tokens, 128, dtype=torch.float16, device="cuda")
    out = torch.empty(tokens, 352, dtype=torch.float16, device="cuda")
    chain(x)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(chain(x))
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        # fp16 between the factors: the error of two roundings, against the product in float64
        assert rel_error(out, x.double() @ dense.double().T) < 4e-3
    with ops.backend("torch"):
        assert rel_error(chain(x), x.double() @ dense.double().T) < 4e-3


requires_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                   reason="the KS wgmma kernel needs an sm_90 GPU")

# (pattern, the next factor's (c, d) or None): d = 1, 3, 4 with odd a, b and c partial tiles (b = 136, 200; c not a
# multiple of the 64-wide k block), outputs into the natural order and into a next factor's batch-major order.
# d >= 4 into the natural order runs the GEMMs into the batch-major order and a block transpose from tokens * d >=
# 1024 (at 300 tokens), the stride-d stores below.
WGMMA_CASES = [((3, 40, 24, 1), None), ((1, 136, 200, 1), None), ((4, 64, 64, 1), (64, 4)), ((3, 40, 24, 1), (8, 15)),
               ((1, 64, 96, 4), None), ((3, 24, 72, 3), None), ((3, 24, 72, 3), (72, 3)), ((2, 200, 40, 4), (40, 20)),
               ((2, 48, 16, 16), None)]


def wgmma_problem(pattern, following, tokens, dtype, seed=0):
    """The kernel's inputs for factor `pattern` on x [tokens, a·c·d] (batch-major when d > 1) and the float64
    expectation in the output order `following` asks for."""
    x, factor = problem(pattern, tokens, dtype, seed)
    _, _, c, d = pattern
    next_c, next_d = following or (1, 1)
    expected = ops.ksmm_reference(x.double(), factor.double())
    if next_d > 1:
        expected = ops.to_batch_major(expected, next_c, next_d)
    return ops.to_batch_major(x, c, d).contiguous(), ops.ksmm_groups(factor), (d, next_c, next_d), expected


@requires_sm90
@pytest.mark.memcheck_skip
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tile_n", ops.KSMM_WGMMA_TILES)
@pytest.mark.parametrize("tokens", [1, 17, 300])
@pytest.mark.parametrize("case", WGMMA_CASES, ids=str)
def test_wgmma_matches_float64(case, tokens, tile_n, dtype):
    x, groups, order, expected = wgmma_problem(*case, tokens, dtype, seed=tokens)
    out = torch.full(expected.shape, float("nan"), dtype=dtype, device="cuda")
    ops.ksmm_wgmma(x, groups, *order, out, tile_n=tile_n)
    assert rel_error(out, expected) < TOLERANCE[dtype]


@requires_sm90
@pytest.mark.racecheck
@pytest.mark.parametrize("case, tokens", [(((3, 24, 72, 3), (72, 3)), 70), (((1, 136, 200, 1), None), 130)], ids=str)
def test_wgmma_under_the_sanitizer(case, tokens):
    """Memcheck and racecheck cases: the stage ring over partial tiles, both output orders."""
    x, groups, order, expected = wgmma_problem(*case, tokens, torch.bfloat16)
    assert rel_error(ops.ksmm_wgmma(x, groups, *order), expected) < TOLERANCE[torch.bfloat16]


# (matrices, rows, cols): the kernel with the long side rows or cols, whole matrices a tile (several, one), a
# partial last tile, one short element, the longest short side; then shapes it leaves to the ATen copy.
TRANSPOSE_SHAPES = [(37, 24, 4), (3, 64, 64), (5, 4, 1000), (6, 1000, 4), (2, 3, 5000), (2, 5000, 3), (4, 8, 1),
                    (3, 1, 16), (9, 16, 2048), (2, 2048, 16), (1, 1032, 1024), (2, 130, 70), (4, 7, 9)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", TRANSPOSE_SHAPES, ids=str)
def test_transpose_blocks_is_the_permutation(shape, dtype):
    matrices, rows, cols = shape
    x = torch.randn(matrices, rows * cols, device="cuda").to(dtype)
    assert torch.equal(ops.transpose_blocks(x, rows, cols), ops.transpose_blocks_reference(x, rows, cols))


@pytest.mark.racecheck
@pytest.mark.memcheck_skip
def test_transpose_blocks_opcheck_and_refusals():
    x = torch.randn(6, 600, dtype=torch.float16, device="cuda")
    out = torch.empty_like(x)
    torch.ops.minfer.ksmm_transpose_blocks(x, 24, 25, out)
    assert torch.equal(out, ops.transpose_blocks_reference(x, 24, 25))
    torch.library.opcheck(torch.ops.minfer.ksmm_transpose_blocks, (x, 24, 25, out))
    with pytest.raises(RuntimeError, match="do not tile"):
        torch.ops.minfer.ksmm_transpose_blocks(x, 7, 25, out)
    with pytest.raises(RuntimeError, match="must not overlap"):
        torch.ops.minfer.ksmm_transpose_blocks(x, 24, 25, x)
    misaligned = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")[1:].view_as(x).copy_(x)
    assert torch.equal(ops.transpose_blocks(misaligned, 24, 25), out)  # left to the ATen copy
    with pytest.raises(FormatError, match="do not tile"):
        ops.transpose_blocks(x, 7, 25)


@requires_sm90
@pytest.mark.memcheck_skip
def test_wgmma_large_batch_and_auto_path():
    """Many tiles per SM (the persistent loop) at 2000 tokens, and ops.ksmm taking d = 1 to the kernel from
    KSMM_WGMMA_MIN_TOKENS tokens once that is set."""
    x, groups, order, expected = wgmma_problem((4, 200, 136, 1), None, 2000, torch.float16)
    assert rel_error(ops.ksmm_wgmma(x, groups, *order), expected) < TOLERANCE[torch.float16]
    with ops.ksmm_wgmma_from(64):
        assert ops.ksmm_path((4, 200, 136, 1), 64) == "wgmma"
        assert ops.ksmm_path((4, 200, 136, 1), 63) == "tensor-core"
        x, factor = problem((4, 200, 136, 1), 64, torch.float16)
        assert rel_error(ops.ksmm(x, factor), expected64(x, factor)) < TOLERANCE[torch.float16]
    with ops.ksmm_wgmma_from(None):
        assert ops.ksmm_path((4, 200, 136, 1), 4096) == "tensor-core"


@requires_sm90
@pytest.mark.memcheck_skip
def test_wgmma_refusals_and_opcheck():
    x, groups, order, expected = wgmma_problem((3, 40, 24, 1), (8, 15), 5, torch.float16)
    out = x.new_empty(expected.shape)
    torch.library.opcheck(torch.ops.minfer.ksmm_wgmma, (x, groups, out, *order, 0))
    with pytest.raises(RuntimeError, match="cannot run groups"):  # b = 12: not a multiple of 8
        torch.ops.minfer.ksmm_wgmma(x, groups[:, :12].contiguous(), x.new_empty(5, 36), 1, 1, 1, 0)
    with pytest.raises(RuntimeError, match="does not chain"):
        torch.ops.minfer.ksmm_wgmma(x, groups, out, 1, 7, 3, 0)
    with pytest.raises(RuntimeError, match="tile_n must be"):
        torch.ops.minfer.ksmm_wgmma(x, groups, out, 1, 1, 1, 96)
    misaligned = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")[1:].view_as(x).copy_(x)
    with pytest.raises(RuntimeError, match="cannot run groups"):
        torch.ops.minfer.ksmm_wgmma(misaligned, groups, out, *order, 0)
    # the wrapper falls back to the reference where the kernel cannot run
    assert rel_error(ops.ksmm_wgmma(misaligned, groups, *order), expected) < TOLERANCE[torch.float16]


@requires_sm90
@pytest.mark.parametrize("patterns, gather, plan", [
    ([(4, 64, 64, 1), (1, 64, 64, 4)], False, [True, True]),  # monarch-50's order: d = 4 reads batch-major
    ([(1, 64, 64, 4), (4, 64, 64, 1)], False, [False, True]),  # d > 1 first, a small group: ring tiles, then wgmma
    ([(2, 40, 64, 1), (1, 80, 40, 2), (2, 40, 80, 1)], False, [True, True, True]),
    ([(4, 36, 64, 1), (1, 72, 72, 2)], False, [False, False]),  # b = 36: the ring tiles for both
    # gathers from 64 weights a group: d > 1 first, after a factor on the ring tiles, alone
    ([(1, 64, 64, 4), (4, 64, 64, 1)], True, [True, True]),
    ([(4, 36, 64, 1), (1, 72, 72, 2)], True, [False, True]),
    ([(2, 48, 40, 8)], True, [True]),
    ([(2, 44, 40, 8)], True, [False]),  # b = 44: the ring tiles
], ids=str)
def test_chain_prefill_on_wgmma(patterns, plan, gather, monkeypatch):
    """The format's prefill: which factors run the wgmma kernel, the result against float64, the per-l copies
    counted in nbytes once built, and a captured prefill reading a new input."""
    if gather:
        monkeypatch.setattr(sys.modules["minfer.ops.ksmm"], "KSMM_WGMMA_GATHER_MIN_GROUP", 64)
    generator = torch.Generator().manual_seed(5)
    chain = KSWeight.from_factors([(torch.randn(p, generator=generator) / p[2] ** 0.5).half().cuda()
                                   for p in patterns])
    x = torch.randn(300, chain.in_features, dtype=torch.float16, device="cuda")
    with ops.ksmm_wgmma_from(None):
        assert chain.wgmma_plan(x) == [None] * len(patterns)
    with ops.ksmm_wgmma_from(64):
        assert [order is not None for order in chain.wgmma_plan(x)] == plan
        assert chain.wgmma_plan(x[:63]) == [None] * len(patterns)
        before = chain.nbytes
        dense = chain.to_dense().double()
        assert rel_error(chain(x), x.double() @ dense.T) < 4e-3 * len(patterns)
        copies = sum(f.numel() * 2 for f, on in zip(chain.factors, plan) if on and f.shape[3] > 1)
        assert chain.nbytes == before + copies
        out = torch.empty(300, chain.out_features, dtype=torch.float16, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(chain(x))
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_error(out, x.double() @ dense.T) < 4e-3 * len(patterns)


@requires_sm90
@pytest.mark.memcheck_skip
@pytest.mark.parametrize("patterns", [
    [(1, 64, 64, 4), (4, 64, 64, 1), (1, 64, 64, 4)],  # gathered first; the second writes the third's order
    [(2, 40, 64, 1), (1, 80, 40, 2), (2, 40, 80, 1)],
    [(2, 48, 40, 8)],  # gathered, alone
], ids=str)
def test_wgmma_chain_op_is_the_per_factor_path(patterns, monkeypatch):
    """minfer.ksmm_wgmma_chain on the groups and plan the format caches (KSWeight.prefill_steps) is the per-factor
    wgmma path (to_batch_major where it gathers, ops.ksmm_wgmma) bit for bit and the chain against float64; the
    format's forward is that one op."""
    monkeypatch.setattr(sys.modules["minfer.ops.ksmm"], "KSMM_WGMMA_GATHER_MIN_GROUP", 64)
    generator = torch.Generator().manual_seed(7)
    chain = KSWeight.from_factors([(torch.randn(p, generator=generator) / p[2] ** 0.5).half().cuda()
                                   for p in patterns])
    x = torch.randn(300, chain.in_features, dtype=torch.float16, device="cuda")
    with ops.ksmm_wgmma_from(64):
        steps = chain.prefill_steps(x)
        assert steps.chain is not None
        got = torch.ops.minfer.ksmm_wgmma_chain(x, *steps.chain)
        expected = x
        for weights, order, gather in steps.per_factor:
            if gather is not None:
                expected = ops.to_batch_major(expected, *gather).contiguous()
            expected = ops.ksmm_wgmma(expected, weights, *order)
        assert torch.equal(got, expected)
        assert torch.equal(chain(x), got)
    assert rel_error(got, x.double() @ chain.to_dense().double().T) < 4e-3 * len(patterns)


@requires_sm90
@pytest.mark.memcheck_skip
def test_wgmma_chain_refusals_and_opcheck(monkeypatch):
    monkeypatch.setattr(sys.modules["minfer.ops.ksmm"], "KSMM_WGMMA_GATHER_MIN_GROUP", 64)
    generator = torch.Generator().manual_seed(8)
    chain = KSWeight.from_factors([(torch.randn(p, generator=generator) / p[2] ** 0.5).half().cuda()
                                   for p in [(1, 64, 64, 4), (4, 64, 64, 1)]])
    x = torch.randn(20, 256, dtype=torch.float16, device="cuda")
    with ops.ksmm_wgmma_from(17):
        groups, plan = chain.prefill_steps(x).chain
    assert plan == [4, 1, 1, 64, 4, 1, 1, 1, 0, 0]
    torch.library.opcheck(torch.ops.minfer.ksmm_wgmma_chain, (x, groups, plan))
    for bad_groups, bad_plan, message in ((groups, plan[:-1], "plan must hold"), ([], [], "at least one factor"),
                                          (groups, [4, 1, 1, 7, 4, *plan[5:]], "does not divide"),
                                          (groups, [4, 1, 1, 64, 4, 1, 7, 3, 0, 0], "does not chain")):
        with pytest.raises(RuntimeError, match=message) as raised:
            torch.ops.minfer.ksmm_wgmma_chain(x, bad_groups, bad_plan)
        assert "\n" not in str(raised.value)
    with pytest.raises(FormatError, match="plan holds"):
        ops.ksmm_wgmma_chain(x, groups, plan[:-1])


# Patterns of the fused decode factors: a == 1 with b even (silu_mul takes those), a > 1, d > 8, and long rows
# over few tiles (a cluster of blocks per tile).
FUSED_PATTERNS = [(1, 64, 96, 4), (4, 40, 24, 1), (1, 48, 16, 16), (1, 130, 200, 1), (2, 20, 512, 2),
                  (1, 32, 1024, 8)]
FUSIONS = [dict(norm=True), dict(residual=True), dict(silu_mul=True), dict(norm=True, silu_mul=True),
           dict(norm=True, residual=True)]


def fused_problem(pattern, tokens, dtype, fusion, seed=0):
    x, factor = problem(pattern, tokens, dtype, seed)
    a, b, _, d = pattern
    generator = torch.Generator().manual_seed(seed + 1)
    norm = (torch.rand(x.shape[1], generator=generator) + 0.5).to(dtype=dtype, device="cuda") \
        if fusion.get("norm") else None
    outputs = a * b * d // 2 if fusion.get("silu_mul") else a * b * d
    residual = torch.randn(tokens, outputs, generator=generator).to(dtype=dtype, device="cuda") \
        if fusion.get("residual") else None
    return x, factor, norm, residual


@pytest.mark.memcheck_skip
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fusion", FUSIONS, ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("pattern", FUSED_PATTERNS, ids=str)
def test_fused_gemv_matches_float64(pattern, tokens, fusion, dtype):
    silu = fusion.get("silu_mul", False)
    if silu and pattern[0] != 1:
        pytest.skip("silu_mul takes a == 1 (test_fused_gemv_refusals covers it)")
    x, factor, norm, residual = fused_problem(pattern, tokens, dtype, fusion, seed=tokens)
    expected = ops.ksmm_gemv_reference(x.double(), factor.double(), None if norm is None else norm.double(), 1e-5,
                                       None if residual is None else residual.double(), silu)
    out = residual.clone() if residual is not None else None
    got = ops.ksmm_gemv(x, factor, out, norm_weight=norm, eps=1e-5, accumulate=residual is not None, silu_mul=silu)
    assert rel_error(got, expected) < TOLERANCE[dtype]


@pytest.mark.racecheck
@pytest.mark.parametrize("pattern, tokens, fusion", [((2, 20, 512, 2), 1, dict(norm=True, residual=True)),
                                                     ((1, 32, 1024, 8), 9, dict(norm=True, silu_mul=True)),
                                                     ((1, 32, 1024, 8), 1, dict(residual=True))], ids=str)
def test_fused_gemv_under_the_sanitizer(pattern, tokens, fusion):
    """The norm's cross-warp sums of squares, the cluster's reduction (4 and 8 blocks per tile), and the rows
    kernel's residual add after its shared-memory reduction (one token)."""
    x, factor, norm, residual = fused_problem(pattern, tokens, torch.float16, fusion)
    silu = fusion.get("silu_mul", False)
    expected = ops.ksmm_gemv_reference(x.double(), factor.double(), None if norm is None else norm.double(), 1e-5,
                                       None if residual is None else residual.double(), silu)
    got = ops.ksmm_gemv(x, factor, residual, norm_weight=norm, eps=1e-5, accumulate=residual is not None,
                        silu_mul=silu)
    assert rel_error(got, expected) < TOLERANCE[torch.float16]


@pytest.mark.memcheck_skip
def test_fused_gemv_refusals_and_opcheck():
    x, factor = problem((2, 20, 24, 2), 3, torch.float16)
    with pytest.raises(RuntimeError, match="silu_mul: a == 1"):
        torch.ops.minfer.ksmm_gemv(x, factor, x.new_empty(3, 40), None, 0.0, False, True)
    with pytest.raises(RuntimeError, match="norm_weight must be"):
        torch.ops.minfer.ksmm_gemv(x, factor, x.new_empty(3, 80), x.new_ones(7), 0.0, False, False)
    x, factor = problem((1, 64, 96, 4), 3, torch.float16)
    norm = x.new_ones(384)
    torch.library.opcheck(torch.ops.minfer.ksmm_gemv, (x, factor, x.new_empty(3, 256), norm, 1e-5, False, False))
    torch.library.opcheck(torch.ops.minfer.ksmm_gemv, (x, factor, x.new_zeros(3, 256), None, 0.0, True, False))
    torch.library.opcheck(torch.ops.minfer.ksmm_gemv, (x, factor, x.new_empty(3, 128), norm, 1e-5, False, True))


@pytest.mark.parametrize("tokens", [1, 5])
def test_fused_projections_match_the_unfused_steps_and_graph_replays(tokens):
    """KSWeight.project with the norm, the MLP activation and the residual add fused into its factors (the
    decode path of the model), inside a CUDA graph, against the same steps as ops of their own (torch backend)."""
    generator = torch.Generator().manual_seed(5)

    def chain(shape):
        return KSWeight.from_factors([(torch.randn(p, generator=generator) / p[2] ** 0.5).half().cuda()
                                      for p in monarch_chain(shape, 0.5)])

    gate_up, down = chain((2 * 176, 128)), chain((128, 176))
    norm = (torch.rand(128, generator=generator) + 0.5).half().cuda()
    residual = torch.randn(tokens, 128, dtype=torch.float16, device="cuda")
    stream = residual.clone()

    def mlp(stream):
        return down.project(gate_up.project(stream, norm, 1e-5, silu_mul=True), residual=stream)

    mlp(stream.clone())  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mlp(stream)
    for _ in range(2):
        residual.copy_(torch.randn_like(residual))
        stream.copy_(residual)
        graph.replay()
        torch.cuda.synchronize()
        with ops.backend("torch"):
            expected = mlp(residual.clone())
        assert rel_error(stream, expected) < 4e-3
