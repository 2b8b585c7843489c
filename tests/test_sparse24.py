"""2:4 sparse weights: the layout byte for byte (the GEMV's metadata order word for word), refusals, N:M pruning,
and the GEMV and decompression kernels against float64 at odd sizes, fused against unfused, opcheck and graph
capture."""

import pytest
import torch

from minfer import ops
from minfer.errors import FormatError, MinferError
from minfer.formats import FORMATS
from minfer.formats import sparse24 as sparse24_format
from minfer.ops import sparse24 as sparse24_ops
from minfer.sparsity import prune_to_structure_
from tests.conftest import requires_cuda
from tests.numerics import fused_linear_reference64, rel_error
from tests.test_kernel_limits import constants

Sparse24 = FORMATS["2:4"]
DTYPES = [torch.float16, torch.bfloat16]
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def matrix_24(rows: int, cols: int, dtype=torch.float16, device="cpu", seed: int = 0) -> torch.Tensor:
    """A random matrix pruned to its 2 largest of every 4 columns, scaled to unit-variance products."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=generator) / (cols / 2) ** 0.5
    return prune_to_structure_(w, w.abs(), (2, 4)).to(dtype=dtype, device=device)


def test_worked_example_byte_for_byte():
    """docs/FORMATS.md's example: one row of 8 columns, padded to one 32-column chunk."""
    row = torch.tensor([[0, 7, 0, 3, 1, 0, 0, 0]], dtype=torch.float16)
    fmt = Sparse24.from_dense(row)
    assert fmt.values.shape == (1, 16) and fmt.meta.shape == (1, 1)
    # group 0 keeps slots 1, 3; group 1 its nonzero slot 0 and the lowest zero slot 1; padding groups 0, 1
    assert fmt.values[0, :4].tolist() == [7, 3, 1, 0] and not fmt.values[0, 4:].any()
    assert fmt.meta.item() == 0x4444_444D  # nibbles, group 0 lowest: 0b1101 (slots 1, 3), then 0b0100 (0, 1)
    assert fmt.nbytes == 16 * 2 + 4 and torch.equal(fmt.to_dense(), row)


def test_metadata_round_trip_at_odd_sizes():
    for rows, cols in ((1, 1), (3, 5), (17, 33), (70, 203), (5, 64)):
        w = matrix_24(rows, cols, torch.float32, seed=cols)
        fmt = Sparse24.from_dense(w)
        assert torch.equal(fmt.to_dense(), w)
        rebuilt = Sparse24.from_tensors(fmt.tensors(), fmt.shape, fmt.options())
        rebuilt.check()
        assert torch.equal(rebuilt.to_dense(), w)


def test_refuses_a_matrix_that_is_not_2_4_naming_the_first_bad_group():
    w = matrix_24(6, 40)
    w[4, 9:12] = 1.0  # columns 8..11 of row 4 now hold 3 or 4 nonzeros
    w[5, 0:4] = 1.0
    with pytest.raises(FormatError, match="row 4, columns 8..11"):
        Sparse24.from_dense(w)
    tail = torch.zeros(1, 6, dtype=torch.float16)
    tail[0, 3:6] = 1.0  # the last, short group 4..5 holds 2: fine; group 0..3 holds 1
    assert torch.equal(Sparse24.from_dense(tail).to_dense(), tail)
    tail[0, 1:3] = 1.0
    with pytest.raises(FormatError, match="row 0, columns 0..3 hold 3"):
        Sparse24.from_dense(tail)


def test_check_refuses_bad_metadata_and_nonzero_padding():
    fmt = Sparse24.from_dense(matrix_24(3, 40))
    bad = fmt.meta.clone()
    bad[1, 0] = bad[1, 0] & ~0xF0 | 0x50  # group 1 of row 1: slots 1, 1
    with pytest.raises(FormatError, match="row 1, group 1"):
        Sparse24.from_tensors({"values": fmt.values, "meta": bad}, fmt.shape, {}).check()
    values = fmt.values.clone()
    values[2, -1] = 1.0  # a kept value in the padding past column 40
    with pytest.raises(FormatError, match="past the matrix's 40 columns"):
        Sparse24.from_tensors({"values": values, "meta": fmt.meta}, fmt.shape, {}).check()
    with pytest.raises(FormatError, match="int32"):
        Sparse24.from_tensors({"values": fmt.values, "meta": fmt.meta.long()}, fmt.shape, {})


def test_pruning_to_n_m_keeps_the_largest_of_each_group():
    w = torch.tensor([[1.0, -4.0, 3.0, 2.0, 5.0, 0.5, -6.0, 7.0, 1.0, 2.0, 3.0]])
    pruned = prune_to_structure_(w.clone(), w.abs(), (2, 4))
    assert pruned.tolist() == [[0.0, -4.0, 3.0, 0.0, 0.0, 0.0, -6.0, 7.0, 0.0, 2.0, 3.0]]
    scores = torch.arange(11.0)[None].flip(1)  # a score other than |w|: the first of each group win
    assert prune_to_structure_(w.clone(), scores, (1, 4)).ne(0).sum() == 3
    with pytest.raises(MinferError, match="0 < N < M"):
        prune_to_structure_(w.clone(), w.abs(), (4, 4))


def test_gemv_reference_path_on_cpu_with_fusions():
    w = matrix_24(10, 44)
    fmt = Sparse24.from_dense(w)
    x = torch.randn(3, 44, dtype=torch.float16)
    g = torch.rand(44, dtype=torch.float16) + 0.5
    residual = torch.randn(3, 10, dtype=torch.float16)
    arrays = (fmt.values, fmt.meta, fmt.gemv_metadata())
    out = ops.sparse24_gemv(x, *arrays, residual.clone(), norm_weight=g, eps=1e-5, accumulate=True)
    assert rel_error(out, fused_linear_reference64(x, w, g, 1e-5, residual)) < 2e-3
    with pytest.raises(FormatError, match="1..16 tokens"):
        ops.sparse24_gemv(torch.randn(17, 44, dtype=torch.float16), *arrays)
    with pytest.raises(FormatError, match="K=100"):
        ops.sparse24_gemv(torch.randn(1, 100, dtype=torch.float16), *arrays)


def gemv_metadata_by_loops(meta: torch.Tensor) -> list[list[list[list[int]]]]:
    """The GEMV metadata order word by word: [R8][S][8][4], word [b][step][g][t] of row 8 b + g holding half t % 2
    of meta words 4 step + t // 2 (low 16 bits) and 4 step + t // 2 + 2 (high), padding 0x44444444."""
    rows, words = meta.shape
    row_groups, steps = -(-rows // 8), -(-words // 4)

    def half(row: int, word: int, t: int) -> int:
        value = int(meta[row, word]) & 0xFFFFFFFF if row < rows and word < words else 0x44444444
        return (value >> 16 * (t % 2)) & 0xFFFF

    return [[[[half(8 * b + g, 4 * step + t // 2, t) | half(8 * b + g, 4 * step + t // 2 + 2, t) << 16
               for t in range(4)] for g in range(8)] for step in range(steps)] for b in range(row_groups)]


def test_gemv_metadata_matches_loops_at_odd_sizes():
    """Rows off the 8-row groups and words off the 4-word steps (columns off 128), and neither."""
    for rows, cols in ((13, 200), (5, 36), (16, 128), (9, 4104)):
        meta = Sparse24.from_dense(matrix_24(rows, cols, torch.float32, seed=rows)).meta
        gemv = ops.sparse24_gemv_metadata(meta)
        assert gemv.dtype == torch.int32 and gemv.shape == (-(-rows // 8), -(-meta.shape[1] // 4), 8, 4)
        assert (gemv.long() & 0xFFFFFFFF).tolist() == gemv_metadata_by_loops(meta), (rows, cols)


def test_gemv_metadata_constants_match_the_header():
    found = constants("sparse24/sparse24.h")
    assert (found["kSparse24GemvRowGroup"], found["kSparse24GemvStepChunks"]) == (
        sparse24_ops.SPARSE24_GEMV_ROW_GROUP, sparse24_ops.SPARSE24_GEMV_STEP_CHUNKS)


def test_gemv_metadata_is_cached_counted_and_rebuilt_when_meta_changes():
    fmt = Sparse24.from_dense(matrix_24(10, 44))
    before = fmt.nbytes
    first = fmt.gemv_metadata()
    assert fmt.gemv_metadata() is first and fmt.nbytes == before + first.numel() * 4
    fmt.meta.copy_(Sparse24.from_dense(matrix_24(10, 44, seed=1)).meta)  # a loader filling the buffer in place
    assert fmt.gemv_metadata() is not first
    assert torch.equal(fmt.gemv_metadata(), ops.sparse24_gemv_metadata(fmt.meta))


# (N, K): N off the 16-row tile; K with a partial last 4-chunk step, steps not a multiple of the 8 warps,
# a chunk past K (K % 32 != 0); K % 8 != 0 runs the scalar fallback; the Llama-2-7B down projection.
SHAPES = [(1, 8), (70, 200), (77, 1000), (129, 4096), (300, 4104), (33, 1001), (4096, 11008)]


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 2, 5, 8, 9, 13, 16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_matches_float64(n, k, tokens, dtype):
    w = matrix_24(n, k, dtype, "cuda", seed=n + k)
    fmt = Sparse24.from_dense(w)
    x = torch.randn(tokens, k, dtype=dtype, device="cuda")
    out = ops.sparse24_gemv(x, fmt.values, fmt.meta, fmt.gemv_metadata())
    assert rel_error(out, x.double() @ w.double().T) < TOLERANCE[dtype]


@requires_cuda
@pytest.mark.memcheck
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 11])
@pytest.mark.parametrize("n,k", [(70, 200), (34, 203)])
@pytest.mark.parametrize("fusion", [dict(norm=True), dict(residual=True), dict(norm=True, silu_mul=True),
                                    dict(norm=True, residual=True), dict(silu_mul=True)], ids=lambda f: "+".join(f))
def test_fused_epilogues_match_the_unfused_path(n, k, tokens, dtype, fusion):
    w = matrix_24(n, k, dtype, "cuda", seed=3)
    fmt = Sparse24.from_dense(w)
    x = torch.randn(tokens, k, dtype=dtype, device="cuda")
    g = (torch.rand(k, device="cuda") + 0.5).to(dtype) if fusion.get("norm") else None
    silu_mul = fusion.get("silu_mul", False)
    residual = torch.randn(tokens, n, dtype=dtype, device="cuda") if fusion.get("residual") else None
    out = ops.sparse24_gemv(x, fmt.values, fmt.meta, fmt.gemv_metadata(),
                            None if residual is None else residual.clone(), norm_weight=g, eps=1e-5,
                            accumulate=residual is not None, silu_mul=silu_mul)
    unfused = ops.rms_norm(x, g, 1e-5) if g is not None else x
    unfused = unfused.double() @ w.double().T
    if silu_mul:
        gate, up = unfused.chunk(2, dim=-1)
        unfused = torch.nn.functional.silu(gate) * up
    if residual is not None:
        unfused = unfused + residual.double()
    expected = fused_linear_reference64(x, w, g, 1e-5, residual, silu_mul, round_scaled_x=True)
    assert rel_error(out, expected) < 2 * TOLERANCE[dtype]
    assert rel_error(out, unfused) < 4 * TOLERANCE[dtype]


@requires_cuda
@pytest.mark.memcheck
@pytest.mark.parametrize("tokens", [1, 5, 9, 16])
@pytest.mark.parametrize("fusion", [dict(), dict(residual=True), dict(norm=True), dict(norm=True, residual=True),
                                    dict(norm=True, silu_mul=True)], ids=lambda f: "+".join(f) or "plain")
def test_gemv_blocks_of_8_warps(tokens, fusion):
    """A block holds two 16-row tiles (x read once per 32 rows): blocks of 8 warps, 2 an SM, where they fill every
    block slot, as here (fewer rows, as in the other tests, take blocks of 16 warps); the row count leaves the last
    block's second tile one row (silu_mul: one gate row)."""
    multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
    silu_mul = fusion.get("silu_mul", False)
    tile_rows = 8 if silu_mul else 16  # outputs of a row tile
    outputs = tile_rows * (4 * multiprocessors - 1) + 1  # 4 tiles an SM: 2 blocks, each of 2 tiles
    n, k = (2 * outputs if silu_mul else outputs), 200
    w = matrix_24(n, k, torch.float16, "cuda", seed=13)
    fmt = Sparse24.from_dense(w)
    x = torch.randn(tokens, k, dtype=torch.float16, device="cuda")
    g = (torch.rand(k, device="cuda") + 0.5).half() if fusion.get("norm") else None
    residual = torch.randn(tokens, n, dtype=torch.float16, device="cuda") if fusion.get("residual") else None
    out = ops.sparse24_gemv(x, fmt.values, fmt.meta, fmt.gemv_metadata(),
                            None if residual is None else residual.clone(), norm_weight=g, eps=1e-5,
                            accumulate=residual is not None, silu_mul=silu_mul)
    expected = fused_linear_reference64(x, w, g, 1e-5, residual, silu_mul, round_scaled_x=True)
    assert rel_error(out, expected) < 2 * TOLERANCE[torch.float16]


@requires_cuda
@pytest.mark.racecheck
def test_gemv_partials_hand_over_without_races():
    """The warps' partial sums reduced through shared memory, under racecheck: 16 tokens in 8-warp blocks with
    the norm and the residual fused."""
    test_gemv_blocks_of_8_warps(16, dict(norm=True, residual=True))


@requires_cuda
@pytest.mark.memcheck
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k", [(70, 203), (129, 4096), (5, 36)])
def test_decompress_kernel_matches_the_reference(n, k, dtype):
    fmt = Sparse24.from_dense(matrix_24(n, k, dtype, "cuda", seed=k))
    expected = ops.sparse24_decompress_reference(fmt.values, fmt.meta, k)
    assert torch.equal(ops.sparse24_decompress(fmt.values, fmt.meta, k), expected)
    wide = torch.full((n, k + 3), float("nan"), dtype=dtype, device="cuda")
    ops.sparse24_decompress(fmt.values, fmt.meta, k, out=wide[:, :k].contiguous())  # a copy: stays NaN
    assert wide.isnan().all()


@requires_cuda
@pytest.mark.memcheck
def test_gemv_metadata_kernel_matches_the_reference():
    """The kernel builder against the tensor-op one at odd sizes; the GEMV refuses a gemv_meta of other rows."""
    for rows, cols in ((13, 200), (70, 203), (300, 4104), (8, 128)):
        meta = Sparse24.from_dense(matrix_24(rows, cols, device="cuda", seed=rows)).meta
        assert torch.equal(ops.sparse24_gemv_metadata(meta).cpu(), ops.sparse24_gemv_metadata(meta.cpu()))
    fmt = Sparse24.from_dense(matrix_24(16, 96, device="cuda"))
    x = torch.randn(1, 96, dtype=torch.float16, device="cuda")
    out = torch.empty(1, 16, dtype=torch.float16, device="cuda")
    other_rows = Sparse24.from_dense(matrix_24(24, 96, device="cuda")).gemv_metadata()
    with pytest.raises(RuntimeError, match=r"gemv_meta must be int32 \[2, 1, 8, 4\]"):
        torch.ops.minfer.sparse24_gemv(x, fmt.values, fmt.meta, other_rows, out)


@requires_cuda
@pytest.mark.racecheck
def test_sublayer_chain_in_cuda_graph():
    """The o projection adds into the residual; the next qkv projection reads it with the norm fused, in one
    graph (the PDL wait must order them)."""
    n, k = 96, 256
    first = Sparse24.from_dense(matrix_24(k, n, device="cuda", seed=1))
    second = Sparse24.from_dense(matrix_24(n, k, device="cuda", seed=2))
    x = torch.randn(2, n, dtype=torch.float16, device="cuda")
    residual = torch.randn(2, k, dtype=torch.float16, device="cuda")
    g = torch.rand(k, dtype=torch.float16, device="cuda") + 0.5
    out = torch.empty(2, n, dtype=torch.float16, device="cuda")
    start = residual.clone()
    first_arrays = (first.values, first.meta, first.gemv_metadata())  # built before the capture, as the engine's
    second_arrays = (second.values, second.meta, second.gemv_metadata())  # eager warm-up step does
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.sparse24_gemv(x, *first_arrays, residual, accumulate=True)
        ops.sparse24_gemv(residual, *second_arrays, out, norm_weight=g, eps=1e-5)
    residual.copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    added = fused_linear_reference64(x, first.to_dense(), None, 0.0, start)
    assert rel_error(residual, added) < 2e-3
    assert rel_error(out, fused_linear_reference64(residual, second.to_dense(), g, 1e-5, None,
                                                   round_scaled_x=True)) < 4e-3


@requires_cuda
@pytest.mark.memcheck_skip
@pytest.mark.parametrize("tokens", [1, 12])
def test_opcheck(tokens):
    fmt = Sparse24.from_dense(matrix_24(64, 96, device="cuda"))
    x = torch.randn(tokens, 96, dtype=torch.float16, device="cuda")
    g = torch.rand(96, dtype=torch.float16, device="cuda") + 0.5
    out = torch.empty(tokens, 64, dtype=torch.float16, device="cuda")
    arrays = (fmt.values, fmt.meta, fmt.gemv_metadata())
    torch.library.opcheck(torch.ops.minfer.sparse24_gemv.default, (x, *arrays, out))
    torch.library.opcheck(torch.ops.minfer.sparse24_gemv.default, (x, *arrays, out, g, 1e-5, True))
    torch.library.opcheck(torch.ops.minfer.sparse24_gemv.default,
                          (x, *arrays, out[:, :32].contiguous(), g, 1e-5, False, True))
    dense = torch.empty(64, 96, dtype=torch.float16, device="cuda")
    torch.library.opcheck(torch.ops.minfer.sparse24_decompress.default, (fmt.values, fmt.meta, dense))
    torch.library.opcheck(torch.ops.minfer.sparse24_gemv_metadata.default, (fmt.meta,))


# ---- the prefill GEMM (sm_90, wgmma.mma_async.sp) and its metadata order ----



def test_gemm_metadata_matches_the_formula_and_round_trips():
    for rows, cols in ((70, 200), (300, 4104), (8, 64)):
        meta = Sparse24.from_dense(matrix_24(rows, cols, torch.float32, seed=rows)).meta
        gemm = ops.sparse24_gemm_metadata(meta)
        words = meta.shape[1]
        assert gemm.dtype == torch.int32 and gemm.shape == (-(-rows // 256) * 4, -(-words // 4) * 2, 128)
        padded = torch.full((gemm.shape[0] * 64, gemm.shape[1] * 2), 0x44444444, dtype=torch.int64)
        padded[:rows, :words] = meta.long() & 0xFFFFFFFF
        flat = gemm.long() & 0xFFFFFFFF
        for b, a, w, t, g, s in torch.cartesian_prod(*(torch.arange(n) for n in gemm.shape[:2]),
                                                     torch.arange(4), torch.arange(2), torch.arange(8),
                                                     torch.arange(2))[::7].tolist():
            row, word = 64 * b + 16 * w + g, 2 * a + s
            expected = (padded[row, word] >> 16 * t) & 0xFFFF | ((padded[row + 8, word] >> 16 * t) & 0xFFFF) << 16
            assert flat[b, a, 32 * w + 16 * t + 2 * g + s] == expected, (rows, cols, b, a, w, t, g, s)
        assert torch.equal(ops.sparse24_meta_from_gemm_metadata(gemm, rows, words), meta)


def test_gemm_reference_path_on_cpu():
    w = matrix_24(40, 192)
    fmt = Sparse24.from_dense(w)
    x = torch.randn(33, 192, dtype=torch.float16)
    out = ops.sparse24_gemm(x, fmt.values, fmt.gemm_metadata())
    assert rel_error(out, x.double() @ w.double().T) < TOLERANCE[torch.float16]
    with pytest.raises(FormatError, match="K=100"):
        ops.sparse24_gemm(torch.randn(3, 100, dtype=torch.float16), fmt.values, fmt.gemm_metadata())
    with pytest.raises(FormatError, match="tile is one of"):
        ops.sparse24_gemm(x, fmt.values, fmt.gemm_metadata(), tile="64x64")


def gemm_case(m: int, n: int, k: int, dtype, seed: int = 0):
    w = matrix_24(n, k, dtype, "cuda", seed=seed)
    fmt = Sparse24.from_dense(w)
    x = torch.randn(m, k, dtype=dtype, device="cuda")
    return w, fmt, x


def explain_mismatch(out: torch.Tensor, expected: torch.Tensor) -> str:
    """Where the outputs are wrong: a wrong metadata layout or descriptor shows as a pattern in the
    feature index modulo 16 / 64 or the token index modulo 8."""
    bad = (out.double() - expected).abs() > 0.05 * expected.abs().max()
    tokens, features = bad.nonzero(as_tuple=True)
    if tokens.numel() == 0:
        return "no element off by more than 5% of the largest"
    return (f"{tokens.numel()} of {bad.numel()} wrong; features % 64: {sorted(set((features % 64).tolist()))[:16]}; "
            f"tokens % 8: {sorted(set((tokens % 8).tolist()))}; first (token, feature) "
            f"{(int(tokens[0]), int(features[0]))}")


@requires_cuda
@pytest.mark.memcheck
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemm_one_tile(dtype):
    """One CTA's tile: the first thing to look at when the metadata layout or a descriptor is wrong."""
    w, fmt, x = gemm_case(64, 128, 128, dtype, seed=7)
    assert ops.sparse24_gemm_takes(x, 128, 128)
    out = ops.sparse24_gemm(x, fmt.values, fmt.gemm_metadata())
    expected = x.double() @ w.double().T
    assert rel_error(out, expected) < TOLERANCE[dtype], explain_mismatch(out, expected)


@requires_cuda
@pytest.mark.memcheck_skip
@pytest.mark.parametrize("tile", ops.SPARSE24_GEMM_TILES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", [(77, 200, 192), (1, 8, 64), (300, 520, 1024), (513, 4096, 4096),
                                   (129, 4104, 256), (1000, 264, 11008), (4100, 136, 320)])
def test_gemm_matches_float64(m, n, k, dtype, tile):
    """Odd token counts, N off every tile (and off the 256-row metadata padding), an odd number of k-blocks,
    long K (many k-blocks in flight one after another: where the first build went wrong)."""
    w, fmt, x = gemm_case(m, n, k, dtype, seed=m + n)
    out = ops.sparse24_gemm(x, fmt.values, fmt.gemm_metadata(), tile=tile)
    expected = x.double() @ w.double().T
    assert rel_error(out, expected) < TOLERANCE[dtype], explain_mismatch(out, expected)


@requires_cuda
@pytest.mark.racecheck
def test_gemm_several_tiles_per_cta():
    """More tiles than SMs: each CTA runs its ring and its epilogue buffers over several tiles."""
    w, fmt, x = gemm_case(2 * 128 + 5, 128 * 80, 128, torch.float16, seed=3)
    out = ops.sparse24_gemm(x, fmt.values, fmt.gemm_metadata())
    assert rel_error(out, x.double() @ w.double().T) < TOLERANCE[torch.float16]


@requires_cuda
@pytest.mark.memcheck_skip
def test_gemm_gives_the_same_bits_every_time():
    """A race (the first build's metadata registers) shows as results that change from call to call."""
    _, fmt, x = gemm_case(640, 1024, 4096, torch.float16, seed=11)
    first = ops.sparse24_gemm(x, fmt.values, fmt.gemm_metadata())
    for tile in ops.SPARSE24_GEMM_TILES:
        for _ in range(5):
            assert torch.equal(ops.sparse24_gemm(x, fmt.values, fmt.gemm_metadata(), tile=tile), first), tile


@requires_cuda
def test_prefill_runs_the_gemm_where_it_can_and_refuses_the_rest(monkeypatch):
    monkeypatch.setattr(sparse24_format, "GEMM_MIN_TOKENS", 17)
    w = matrix_24(264, 256, device="cuda", seed=5)
    fmt = Sparse24.from_dense(w)
    before = fmt.nbytes
    x = torch.randn(2, 40, 256, dtype=torch.float16, device="cuda")
    assert rel_error(fmt(x), x.double() @ w.double().T) < TOLERANCE[torch.float16]
    assert fmt.nbytes == before + fmt.gemm_metadata().numel() * 4  # the GEMM's metadata copy now counts
    odd = Sparse24.from_dense(matrix_24(264, 200, device="cuda", seed=5))  # K % 64 != 0: decompress + cuBLAS
    assert not ops.sparse24_gemm_takes(x[0, :, :200], 264, 200)
    assert rel_error(odd(x[..., :200]), x[..., :200].double() @ odd.to_dense().double().T) < 2e-3
    with pytest.raises(RuntimeError, match="K % 64 == 0"):
        torch.ops.minfer.sparse24_gemm(x[0, :, :200].contiguous(), odd.values[:, :100].contiguous(),
                                       odd.gemm_metadata(), torch.empty(40, 264, dtype=torch.float16, device="cuda"))


@requires_cuda
@pytest.mark.memcheck_skip
def test_gemm_opcheck():
    _, fmt, x = gemm_case(70, 136, 192, torch.float16)
    out = torch.empty(70, 136, dtype=torch.float16, device="cuda")
    torch.library.opcheck(torch.ops.minfer.sparse24_gemm.default, (x, fmt.values, fmt.gemm_metadata(), out))
