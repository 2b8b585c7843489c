"""MACKO SpMV/SpMM and decompression kernels vs float64 / the exact reference (GPU only)."""

import pytest
import torch

from minfer import ops
from minfer.formats import macko as macko_format
from minfer.formats.macko import MackoWeight, compress
from tests.conftest import requires_cuda
from tests.numerics import assert_graph_replays_read_new_inputs, relative_difference, relative_error, sparse_matrix

pytestmark = [requires_cuda, pytest.mark.memcheck]  # memcheck: see scripts/device_check.sh

DENSITIES = [0.0, 0.02, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0]
TUNINGS = [dict(steps=s, warps_per_block=w, x_in_smem=m, pipeline=1)
           for s in (1, 2) for w in (4, 8, 16) for m in (0, 1)]
TUNINGS.append(dict(steps=1, warps_per_block=16, x_in_smem=0, pipeline=0))  # the reference kernel's schedule


def run_spmv(matrix, tokens, **tuning):
    values, deltas, row_ptr = compress(matrix)
    x = torch.randn(tokens, matrix.shape[1], device="cuda").to(matrix.dtype)
    out = torch.full((tokens, matrix.shape[0]), float("nan"), device="cuda", dtype=matrix.dtype)
    (ops.macko_spmv_tuned if tuning else ops.macko_spmv)(values, deltas, row_ptr, x, out=out, **tuning)
    return out, x


@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("rows, cols", [(1, 7), (37, 1000), (300, 4097), (64, 11008)])
def test_spmv_one_token(rows, cols, density):
    matrix = sparse_matrix(rows, cols, density, seed=rows + cols)
    out, x = run_spmv(matrix, 1)
    if density == 0.0:
        assert torch.equal(out, torch.zeros_like(out))
    else:
        assert relative_error(out, matrix, x) < 2e-3


@pytest.mark.parametrize("tokens", [2, 3, 5, 8, 11, 16, 17, 33])
@pytest.mark.parametrize("density", [0.05, 0.5, 1.0])
def test_spmm_tokens(tokens, density):
    matrix = sparse_matrix(129, 2053, density, seed=tokens)
    out, x = run_spmv(matrix, tokens)
    assert relative_error(out, matrix, x) < 2e-3


@pytest.mark.parametrize("cols, tokens", [(9000, 16), (60000, 1), (60000, 4)])
def test_spmm_wide_rows_take_fewer_tokens_per_pass(cols, tokens):
    # 9000 columns: 8 of the 16 tokens per pass; 60000: x goes past shared memory, gathered from global
    matrix = sparse_matrix(5, cols, 0.3, seed=tokens)
    out, x = run_spmv(matrix, tokens)
    assert relative_error(out, matrix, x) < 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 4, 9])
def test_bf16_and_fp16(dtype, tokens):
    matrix = sparse_matrix(77, 515, 0.4, dtype=dtype, seed=5)
    out, x = run_spmv(matrix, tokens)
    assert relative_error(out, matrix, x) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.parametrize("tuning", TUNINGS,
                         ids=lambda t: "s{steps}w{warps_per_block}m{x_in_smem}p{pipeline}".format(**t))
@pytest.mark.memcheck_skip
def test_every_launch_configuration(tuning):
    matrix = sparse_matrix(517, 1531, 0.35, seed=11, uneven=True)
    matrix[100:140] = 0  # a run of empty rows
    matrix[200, -1] = 1.5  # a row with only its last column set
    matrix[200, :-1] = 0
    for tokens in (1, 6):
        out, x = run_spmv(matrix, tokens, **tuning)
        assert relative_error(out, matrix, x) < 2e-3


@pytest.mark.parametrize("cols, density", [(4096, 0.5), *(pytest.param(*case, marks=pytest.mark.memcheck_skip) for case in (
    (4096, 0.1), (4096, 0.3), (1031, 0.9), (300, 0.02), (2048, 0.25), (520, 1.0), (11008, 0.5)))])
@pytest.mark.parametrize("warps_per_block", [0, 4, 16])
@pytest.mark.parametrize("steps", [0, 1])  # 0: the default, 2 steps
def test_spmv_one_token_every_row(cols, density, warps_per_block, steps):
    """Every row checked on its own, with more rows than resident warps (each warp sums several):
    a mistake at a row boundary spoils one row, which a norm over all rows would hide. Per-row
    pruning to an exact count puts row starts at unaligned entries; 2048 columns at 0.25 give rows of
    one 512-entry group, 520 full columns rows just past one; some rows are emptied, one keeps a
    single entry."""
    matrix = pruned_per_row(9000, cols, density, seed=cols)
    matrix[50:53] = 0
    matrix[4000] = 0
    matrix[4000, 7] = 1.5
    out, x = run_spmv(matrix, 1, warps_per_block=warps_per_block, steps=steps)
    assert_every_row_close(out, matrix, x)


def pruned_per_row(rows, cols, density, seed):
    """The same number of nonzeros in every row, as magnitude and Wanda pruning leave them."""
    matrix = sparse_matrix(rows, cols, 1.0, seed=seed)
    kept = max(1, round(density * cols))
    threshold = matrix.abs().float().topk(kept, dim=1).values[:, -1:]
    matrix[matrix.abs().float() < threshold] = 0
    return matrix


@pytest.mark.parametrize("tokens", [1, 5])
def test_rows_one_chunk_past_whole_groups(tokens):
    """2048 entries per row (4096 columns at d = 0.5, a few more at fp16 ties) fill whole groups, so an
    unaligned row start leaves its last group only the few entries of lane 0's first chunk (decoded
    without a warp scan)."""
    matrix = pruned_per_row(1000, 4096, 0.5, seed=tokens)
    matrix[0, (matrix[0] == 0).nonzero()[:3, 0]] = 1.0  # rows start unaligned (ties at the fp16 cut add more)
    for steps in (1, 2):
        out, x = run_spmv(matrix, tokens, steps=steps)
        assert_every_row_close(out[:1], matrix, x[:1])
        assert relative_error(out, matrix, x) < 2e-3
    values, deltas, row_ptr = compress(matrix)
    past_whole_groups = (row_ptr[1:] - (row_ptr[:-1] & ~7)) % 512  # entries in the last 512-entry group
    assert ((past_whole_groups >= 1) & (past_whole_groups <= 8)).float().mean() > 0.8
    assert torch.equal(ops.macko_decompress(values, deltas, row_ptr, cols=matrix.shape[1]), matrix)


def assert_every_row_close(out, matrix, x):
    ref = x.double() @ matrix.double().T
    scale = x.double().abs() @ matrix.double().abs().T  # the sum of |terms|: no cancellation
    assert not out.isnan().any(), "some rows were never written"
    worst = ((out.double() - ref).abs() / scale.clamp_min(1e-30)).max().item()
    assert worst < 2e-3, f"worst row error {worst}"


@pytest.mark.parametrize("rounds, extra_rows", [(0, 5), (1, -1), (1, 0), (1, 1), (2, -17), (2, 1), (5, 7)])
@pytest.mark.memcheck_skip
def test_spmv_one_token_balanced_grid_every_row(rounds, extra_rows):
    """The default one-token grid gives each of its 2 blocks per SM just enough warps (at most 16) for
    the rows to split into whole rounds: row counts around multiples of 32 warps per SM give blocks
    of 1, 9, 11, 14 or 16 warps and last rounds short by a few rows."""
    slots = 2 * torch.cuda.get_device_properties(0).multi_processor_count * 16
    rows = rounds * slots + extra_rows
    matrix = sparse_matrix(rows, 300, 0.3, seed=rows)
    out, x = run_spmv(matrix, 1)
    assert_every_row_close(out, matrix, x)


@pytest.mark.parametrize("steps", [1, 2])
def test_spmv_one_token_rows_ending_early(steps):
    """Rows whose last nonzero comes early, each followed by a full row: the one-token kernel reads
    the next row's first entries in a row's last chunk, at columns inside x, and must not add them."""
    matrix = sparse_matrix(2001, 3000, 1.0, seed=steps)
    row = torch.arange(2001, device="cuda")[:, None]
    column = torch.arange(3000, device="cuda")
    matrix[(row % 2 == 0) & (column >= 20 + row % 37)] = 0  # even rows end at columns 19..55
    out, x = run_spmv(matrix, 1, steps=steps)
    assert_every_row_close(out, matrix, x)


@pytest.mark.racecheck
def test_long_rows_many_groups():
    matrix = sparse_matrix(3, 50000, 1.0, seed=2)  # 50000 entries per row: ~100 pipeline groups
    out, x = run_spmv(matrix, 1)
    assert relative_error(out, matrix, x) < 2e-3


def test_all_zero_matrix_and_empty_arrays():
    matrix = torch.zeros(10, 40, dtype=torch.float16, device="cuda")
    out, _ = run_spmv(matrix, 3)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, cols", [(1, 1), (33, 17), (257, 1000), (64, 4096)])
@pytest.mark.parametrize("density", [0.0, 0.1, 0.6, 1.0])
def test_decompress_exact(rows, cols, density, dtype):
    matrix = sparse_matrix(rows, cols, density, dtype=dtype, seed=rows * cols, uneven=True)
    values, deltas, row_ptr = compress(matrix)
    out = torch.full_like(matrix, float("nan"))
    ops.macko_decompress(values, deltas, row_ptr, out=out)
    assert torch.equal(out, matrix)
    assert torch.equal(out, ops.macko_decompress_reference(values, deltas, row_ptr, cols))


def test_decompress_after_a_smaller_shared_memory_size():
    """The row-buffer kernel's shared memory grows with K: 11008 columns need more than 4000, and
    a call at 4000 in between must not lower the kernel's limit under the larger, cached size."""
    for cols in (11008, 4000, 11008):
        matrix = sparse_matrix(24, cols, 0.3, seed=cols)
        values, deltas, row_ptr = compress(matrix)
        assert torch.equal(ops.macko_decompress(values, deltas, row_ptr, cols=cols), matrix)


def test_gpu_compression_matches_cpu():
    matrix = sparse_matrix(300, 999, 0.2, seed=9, uneven=True)
    for gpu, cpu in zip(compress(matrix), compress(matrix.cpu())):
        assert torch.equal(gpu.cpu(), cpu)


@pytest.mark.memcheck_skip
def test_opcheck():
    matrix = sparse_matrix(40, 300, 0.3, seed=4)
    values, deltas, row_ptr = compress(matrix)
    for tokens in (1, 5):
        x = torch.randn(tokens, 300, device="cuda", dtype=torch.float16)
        out = torch.empty(tokens, 40, device="cuda", dtype=torch.float16)
        torch.library.opcheck(torch.ops.minfer.macko_spmv,
                              (values, deltas, row_ptr, x, out, None, 0.0, False, False))
    g = torch.rand(300, device="cuda", dtype=torch.float16) + 0.5
    torch.library.opcheck(torch.ops.minfer.macko_spmv,
                          (values, deltas, row_ptr, x[:1], out[:1], g, 1e-5, False, False))
    torch.library.opcheck(torch.ops.minfer.macko_spmv,
                          (values, deltas, row_ptr, x[:1], out.new_empty(1, 20), g, 1e-5, False, True))
    torch.library.opcheck(torch.ops.minfer.macko_spmv_tuned,
                          (values, deltas, row_ptr, x[:1], out[:1], g, 1e-5, True, False, 2, 8, 1, 1))
    dense = torch.empty(40, 300, device="cuda", dtype=torch.float16)
    torch.library.opcheck(torch.ops.minfer.macko_decompress, (values, deltas, row_ptr, dense))


@pytest.mark.parametrize("tokens", [1, 2, 16])
def test_cuda_graph_replay_uses_new_inputs(tokens):
    """One token (x staged as fp32) and SpMM passes (x tiles) read the inputs of each replay."""
    matrix = sparse_matrix(300, 777, 0.5, seed=6)
    values, deltas, row_ptr = compress(matrix)
    x = torch.randn(tokens, 777, device="cuda", dtype=torch.float16)
    out = torch.empty(tokens, 300, device="cuda", dtype=torch.float16)
    assert_graph_replays_read_new_inputs(lambda: ops.macko_spmv(values, deltas, row_ptr, x, out=out), matrix, x, out)


@pytest.mark.parametrize("tokens", [1, 8, 40])
def test_weight_forward_decode_and_prefill_paths(tokens):
    matrix = sparse_matrix(96, 520, 0.3, seed=tokens)
    weight = MackoWeight.from_dense(matrix)
    x = torch.randn(1, tokens, 520, device="cuda", dtype=torch.float16)
    out = weight(x)
    assert out.shape == (1, tokens, 96)
    assert relative_error(out.view(tokens, 96), matrix, x.view(tokens, 520)) < 2e-3
    assert torch.equal(weight.to_dense(), matrix)


@pytest.mark.parametrize("rows, block_rows", [(96, 1), (96, 7), (96, 96), (300, 128)])
def test_prefill_decompresses_blocks_of_rows(monkeypatch, rows, block_rows):
    """Prefill decompresses at most PREFILL_SCRATCH_ELEMENTS weights at a time: single rows, blocks
    with a ragged last one, the whole matrix, and 128-row steps (blocks of 128, 128, 44) give the
    same product."""
    monkeypatch.setattr(macko_format, "PREFILL_SCRATCH_ELEMENTS", block_rows * 520)
    matrix = sparse_matrix(rows, 520, 0.3, seed=block_rows)
    weight = MackoWeight.from_dense(matrix)
    x = torch.randn(40, 520, device="cuda", dtype=torch.float16)
    out = weight(x)
    assert out.shape == (40, rows)
    assert relative_error(out, matrix, x) < 2e-3


@pytest.mark.parametrize("tokens, tuning", [(1, {}), (5, {}), (16, {}), (1, dict(x_in_smem=0)), (1, dict(pipeline=0))],
                         ids=["smem-1", "smem-5", "smem-16", "x-global", "reference"])
def test_spmv_accumulates_into_out(tokens, tuning):
    """accumulate=True adds W x into out in place (the residual add), on every kernel path."""
    matrix = sparse_matrix(300, 1000, 0.3, seed=tokens)
    values, deltas, row_ptr = compress(matrix)
    x = torch.randn(tokens, 1000, device="cuda", dtype=torch.float16)
    residual = torch.randn(tokens, 300, device="cuda", dtype=torch.float16)
    expected = residual.double() + x.double() @ matrix.double().T
    ops.macko_spmv_tuned(values, deltas, row_ptr, x, out=residual, accumulate=True, **tuning)
    assert ((residual.double() - expected).norm() / expected.norm()).item() < 2e-3


def test_weight_project_adds_into_the_residual():
    matrix = sparse_matrix(64, 256, 0.5, seed=3)
    weight = MackoWeight.from_dense(matrix)
    x = torch.randn(1, 1, 256, device="cuda", dtype=torch.float16)
    g = torch.rand(256, device="cuda", dtype=torch.float16) + 0.5
    residual = torch.randn(1, 1, 64, device="cuda", dtype=torch.float16)
    expected = residual.double() + ops.rms_norm_reference(x, g, 1e-5).double() @ matrix.double().T
    assert weight.project(x, g, 1e-5, residual) is residual
    assert ((residual.double() - expected).norm() / expected.norm()).item() < 2e-3


def normed_product(x, g, matrix, eps=1e-5):
    """float64 oracle of the fused norm, (g * x) @ W.T * rsqrt(mean(x^2) + eps), with g * x rounded to
    x's dtype as the kernel stages it (bf16 rounding of a few cancelling terms would otherwise dominate)."""
    scale = torch.rsqrt(x.double().square().mean(dim=-1, keepdim=True) + eps)
    return ((x * g).double() @ matrix.double().T) * scale


@pytest.mark.parametrize("dtype, rows, cols, aligned", [
    pytest.param(dtype, *shape, id=f"{'-'.join(map(str, shape))}-dtype{i}",
                 marks=[pytest.mark.racecheck] if i == 0 and shape in ((37, 1000, True), (300, 4096, False)) else [])
    for i, dtype in enumerate((torch.float16, torch.bfloat16))
    for shape in ((1, 7, True), (37, 1000, True), (300, 4097, True), (64, 11008, True), (5, 16384, True),
                  (300, 4096, False))])
def test_spmv_fuses_the_rms_norm(dtype, rows, cols, aligned):
    """One token with a norm weight runs the norm inside the SpMV (x and g staged by vectors when
    both are 16-byte aligned, one by one otherwise), with and without the residual add."""
    matrix = sparse_matrix(rows, cols, 0.5, dtype=dtype, seed=rows + cols)
    values, deltas, row_ptr = compress(matrix)
    generator = torch.Generator(device="cuda").manual_seed(3 * (rows + cols) + 1)  # not the matrix's stream
    x = (torch.randn(1, cols, device="cuda", generator=generator) * 3).to(dtype)
    g_storage = (torch.rand(cols + 1, device="cuda", generator=generator) + 0.5).to(dtype)
    g = g_storage[:cols] if aligned else g_storage[1:]
    tolerance = 1e-2 if dtype == torch.bfloat16 else 2e-3
    out = ops.macko_spmv(values, deltas, row_ptr, x, norm_weight=g, eps=1e-5)
    expected = normed_product(x, g, matrix)
    assert relative_difference(out, expected) < tolerance
    residual = torch.randn(1, rows, device="cuda", generator=generator).to(dtype)
    expected = expected + residual.double()
    ops.macko_spmv(values, deltas, row_ptr, x, out=residual, norm_weight=g, eps=1e-5, accumulate=True)
    assert relative_difference(residual, expected) < tolerance


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.memcheck_skip
def test_spmv_norm_is_the_same_for_every_launch_shape(seed):
    """The norm's sum of x^2 is added in an order fixed by the columns alone, not by the block's threads
    or x's alignment: 4-warp blocks, 16-warp blocks and x at an unaligned address (the scalar staging
    path) give the same bits. With 16384 outputs, scales an ulp apart would round a few of them the
    other way (the former per-thread order did; the silu fusion's bit-identity rests on this too)."""
    matrix = sparse_matrix(16384, 4096, 0.5, seed=seed)
    values, deltas, row_ptr = compress(matrix)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, 4096, device="cuda", generator=generator).half()
    g = (torch.rand(4096, device="cuda", generator=generator) + 0.5).half()
    shifted = torch.empty(1, 4097, device="cuda", dtype=torch.float16)
    shifted[:, 1:] = x
    inputs = [(x, {}), (x, dict(warps_per_block=4)), (x, dict(warps_per_block=16)), (shifted[:, 1:], {})]
    outs = [ops.macko_spmv_tuned(values, deltas, row_ptr, xi, norm_weight=g, eps=1e-5, **tuning)
            for xi, tuning in inputs]
    assert all(torch.equal(outs[0], out) for out in outs[1:])


@pytest.mark.parametrize("tokens, tuning", [(3, {}), (1, dict(x_in_smem=0)), (1, dict(pipeline=0))],
                         ids=["tokens-3", "x-global", "reference"])
@pytest.mark.parametrize("fusion", ["norm", "silu_mul"])
def test_spmv_fusion_falls_back_to_its_kernel(fusion, tokens, tuning):
    """Inputs the kernel cannot fuse into run the rms_norm or silu_mul kernel instead, with the same result."""
    matrix = sparse_matrix(300, 1000, 0.3, seed=tokens)
    values, deltas, row_ptr = compress(matrix)
    x = torch.randn(tokens, 1000, device="cuda", dtype=torch.float16)
    if fusion == "norm":
        g = torch.rand(1000, device="cuda", dtype=torch.float16) + 0.5
        out = ops.macko_spmv_tuned(values, deltas, row_ptr, x, norm_weight=g, eps=1e-5, **tuning)
        expected = normed_product(x, g, matrix)
    else:
        out = ops.macko_spmv_tuned(values, deltas, row_ptr, x, silu_mul=True, **tuning)
        gate, up = (x.double() @ matrix.double().T).chunk(2, dim=-1)
        expected = torch.nn.functional.silu(gate) * up
    assert out.shape == expected.shape
    assert relative_difference(out, expected) < 2e-3


def test_weight_project_fuses_norm_and_activation():
    """The MLP's gate_up: the norm and silu(gate) * up both inside the SpMV."""
    matrix = sparse_matrix(128, 256, 0.5, seed=5)
    weight = MackoWeight.from_dense(matrix)
    x = torch.randn(1, 1, 256, device="cuda", dtype=torch.float16)
    g = torch.rand(256, device="cuda", dtype=torch.float16) + 0.5
    out = weight.project(x, g, 1e-5, silu_mul=True)
    gate, up = normed_product(x.view(1, 256), g, matrix).chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    assert out.shape == (1, 1, 64)
    assert relative_difference(out.view(1, 64), expected) < 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("half_rows, cols", [(1, 7), (37, 1000), (300, 4097), (64, 11008), (9001, 64)])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
def test_spmv_fuses_silu_mul(dtype, half_rows, cols, norm):
    """One token of a [gate; up] matrix: the kernel walks gate row p and up row p + I on one warp and
    writes silu(gate) * up, bit for bit what the SpMV followed by the silu_mul kernel gives (9001 pairs
    take several rounds of the grid). x is seeded, and the oracle rounds gate and up as the kernel
    reads them: with x from the global RNG, one test order failed the 1% bound at one bf16 pair (a
    single output, and for a negative gate silu moves several times the gate's own rounding)."""
    matrix = sparse_matrix(2 * half_rows, cols, 0.5, dtype=dtype, seed=half_rows + cols)
    values, deltas, row_ptr = compress(matrix)
    generator = torch.Generator(device="cuda").manual_seed(7 * (half_rows + cols) + 1)  # not the matrix's stream
    x = torch.randn(1, cols, device="cuda", generator=generator).to(dtype)
    g = (torch.rand(cols, device="cuda", generator=generator) + 0.5).to(dtype) if norm else None
    fused = torch.full((1, half_rows), float("nan"), device="cuda", dtype=dtype)
    ops.macko_spmv(values, deltas, row_ptr, x, out=fused, norm_weight=g, eps=1e-5, silu_mul=True)
    separate = ops.silu_mul(ops.macko_spmv(values, deltas, row_ptr, x, norm_weight=g, eps=1e-5))
    assert torch.equal(fused, separate)
    product = normed_product(x, g, matrix) if norm else x.double() @ matrix.double().T
    gate, up = (half.to(dtype).double() for half in product.chunk(2, dim=-1))  # rounded as the kernel reads them
    tolerance = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert relative_difference(fused, torch.nn.functional.silu(gate) * up) < tolerance


def small_macko():
    values, deltas, row_ptr = compress(sparse_matrix(8, 64, 0.5))
    return values, deltas, row_ptr, torch.randn(1, 64, device="cuda", dtype=torch.float16)


def test_binding_rejects_dtype_mismatch():
    values, deltas, row_ptr, x = small_macko()
    out = torch.empty(1, 8, device="cuda")
    with pytest.raises(RuntimeError, match="share one dtype"):
        torch.ops.minfer.macko_spmv(values, deltas, row_ptr, x.float(), out, None, 0.0, False, False)


def test_binding_rejects_wrong_out_shape():
    values, deltas, row_ptr, x = small_macko()
    out = torch.empty(1, 9, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="out must be"):
        torch.ops.minfer.macko_spmv(values, deltas, row_ptr, x, out, None, 0.0, False, False)


def test_binding_rejects_misaligned_values():
    values, deltas, row_ptr, x = small_macko()
    misaligned = values.new_empty(values.numel() + 1)[1:]  # 2 bytes past a 16-byte boundary
    out = torch.empty(1, 8, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="aligned"):
        torch.ops.minfer.macko_spmv(misaligned, deltas, row_ptr, x, out, None, 0.0, False, False)


def test_binding_rejects_a_norm_it_cannot_fuse():
    values, deltas, row_ptr, x = small_macko()
    g = torch.ones(64, device="cuda", dtype=torch.float16)
    two_tokens = x.expand(2, 64).contiguous()
    out = torch.empty(2, 8, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="fused for one token"):
        torch.ops.minfer.macko_spmv(values, deltas, row_ptr, two_tokens, out, g, 1e-5, False, False)
    with pytest.raises(RuntimeError, match="norm_weight must be"):
        torch.ops.minfer.macko_spmv(values, deltas, row_ptr, x, out[:1], g[:32], 1e-5, False, False)


def test_binding_rejects_a_silu_mul_it_cannot_fuse():
    values, deltas, row_ptr, x = small_macko()
    half = torch.empty(1, 4, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="no accumulate"):
        torch.ops.minfer.macko_spmv(values, deltas, row_ptr, x, half, None, 0.0, True, True)
    with pytest.raises(RuntimeError, match="fused for one token"):
        torch.ops.minfer.macko_spmv_tuned(values, deltas, row_ptr, x, half, None, 0.0, False, True, 0, 0, 0, 1)
    with pytest.raises(RuntimeError, match="out must be"):
        torch.ops.minfer.macko_spmv(values, deltas, row_ptr, x, half[:, :3], None, 0.0, False, True)
    odd_values, odd_deltas, odd_row_ptr = compress(sparse_matrix(7, 64, 0.5))
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.minfer.macko_spmv(odd_values, odd_deltas, odd_row_ptr, x, half[:, :3], None, 0.0, False, True)
