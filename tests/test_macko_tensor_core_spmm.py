"""The tensor-core MACKO SpMM: its window table (CPU, against a per-row walk) and the kernel against float64
(GPU only)."""

import pytest
import torch

from minfer import ops
from minfer.errors import FormatError
from minfer.formats.macko import MackoWeight, compress
from minfer.ops import macko as macko_ops
from tests.conftest import requires_cuda
from tests.numerics import assert_graph_replays_read_new_inputs, relative_difference, relative_error, sparse_matrix

pytestmark = pytest.mark.memcheck  # scripts/device_check.sh: compute-sanitizer memcheck runs this file

WINDOW = ops.MACKO_WINDOW_COLS


def window_table_by_walking(matrix: torch.Tensor) -> torch.Tensor:
    """The window table from each row's stored entries, one entry at a time (the definition in kernels/macko/macko.h)."""
    values, deltas, row_ptr = compress(matrix)
    nibbles = ops.unpack_nibbles(deltas, int(row_ptr[-1])).tolist()
    windows = max(1, -(-matrix.shape[1] // WINDOW))
    table = torch.zeros(matrix.shape[0], windows - 1, dtype=torch.int32)
    for row in range(matrix.shape[0]):
        start, end = int(row_ptr[row]), int(row_ptr[row + 1])
        column, columns = -1, []
        for i in range(start, end):
            column += 1 + nibbles[i]
            columns.append(column)
        for w in range(1, windows):
            first = next((i for i in range(start, end) if columns[i - start] >= w * WINDOW), end)
            run_start = min(end, -(-first // 8) * 8)
            origin = columns[run_start - start] - nibbles[run_start] - w * WINDOW if run_start < end else 0
            assert -15 <= origin <= 112
            table[row, w - 1] = ((run_start - start) << 7) | (origin + 15)
    return table


def boundary_matrix(rows: int, cols: int) -> torch.Tensor:
    """Rows whose entries and explicit-zero pads sit at and around the window edges."""
    matrix = torch.zeros(rows, cols)
    for row in range(rows):
        for col in range(row % 17, cols, 16 + row % 23):  # gaps of 15 to 37 columns: some need a stored zero
            matrix[row, col] = 1.0 + (row * cols + col) % 7
        for edge in range(WINDOW, cols, WINDOW):
            for col in (edge - 1 - row % 3, edge + row % 5):
                if 0 <= col < cols and row % 4:
                    matrix[row, col] = -2.0
    matrix[rows // 2] = 0  # an empty row
    matrix[rows // 3, :-1] = 0  # a row with only its last column set
    return matrix.half()


@pytest.mark.parametrize("rows, cols, density", [(5, 512, 0.5), (7, 513, 0.3), (33, 1500, 0.05), (9, 4097, 0.9),
                                                 (4, 2048, 0.0), (3, 1030, 1.0), (2, 100, 0.5)])
def test_window_table_matches_a_walk_of_each_row(rows, cols, density):
    generator = torch.Generator().manual_seed(rows * cols)
    matrix = torch.randn(rows, cols, generator=generator)
    matrix[torch.rand(rows, cols, generator=generator) >= density] = 0
    matrix = matrix.half()
    values, deltas, row_ptr = compress(matrix)
    assert torch.equal(ops.macko_window_table(values, deltas, row_ptr, cols), window_table_by_walking(matrix))


def test_window_table_at_window_edges_and_in_row_blocks(monkeypatch):
    matrix = boundary_matrix(40, 2600)
    values, deltas, row_ptr = compress(matrix)
    expected = window_table_by_walking(matrix)
    assert torch.equal(ops.macko_window_table(values, deltas, row_ptr, 2600), expected)
    monkeypatch.setattr(macko_ops, "_MACKO_BLOCK_ENTRIES", 3 * 2600)  # blocks of 1 row
    assert torch.equal(ops.macko_window_table(values, deltas, row_ptr, 2600), expected)


def test_window_table_refuses_arrays_wider_than_the_matrix_and_too_many_columns():
    values, deltas, row_ptr = compress(torch.ones(2, 1200).half())
    with pytest.raises(FormatError, match="past column"):
        ops.macko_window_table(values, deltas, row_ptr, 1100)
    with pytest.raises(FormatError, match="at most 8388608 columns"):
        ops.macko_window_table(values, deltas, row_ptr, ops.MACKO_TENSOR_CORE_MAX_COLS + 1)


def compressed_with_table(matrix):
    """values, deltas, row_ptr and the window table of `matrix`."""
    values, deltas, row_ptr = compress(matrix)
    return values, deltas, row_ptr, ops.macko_window_table(values, deltas, row_ptr, matrix.shape[1])


def tensor_core_product(matrix, tokens, seed=0, k_splits=0, x=None, steps=0):
    values, deltas, row_ptr, table = compressed_with_table(matrix)
    if x is None:
        generator = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(tokens, matrix.shape[1], device="cuda", generator=generator).to(matrix.dtype)
    out = torch.full((tokens, matrix.shape[0]), float("nan"), device="cuda", dtype=matrix.dtype)
    ops.macko_tensor_core_spmm_tuned(values, deltas, row_ptr, table, x, out, k_splits=k_splits, steps=steps)
    return out, x


@requires_cuda
@pytest.mark.parametrize("density", [0.0, 0.02, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("rows, cols", [(1, 7), (63, 513), (65, 1000), (300, 4097),
                                        pytest.param(64, 11008, marks=pytest.mark.memcheck_skip)])
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_tensor_core_spmm(rows, cols, density, tokens):
    matrix = sparse_matrix(rows, cols, density, seed=rows + cols + tokens)
    out, x = tensor_core_product(matrix, tokens, seed=tokens)
    if density == 0.0:
        assert torch.equal(out, torch.zeros_like(out))
    else:
        assert relative_error(out, matrix, x) < 2e-3


@requires_cuda
@pytest.mark.parametrize("tokens, steps", [pytest.param(tokens, steps, marks=pytest.mark.racecheck)
                                           if (tokens, steps) == (13, 1) else (tokens, steps)
                                           for steps in (1, 2) for tokens in (2, 3, 4, 8, 11, 13)])
def test_tensor_core_spmm_every_token_count(tokens, steps):
    matrix = sparse_matrix(129, 2053, 0.5, seed=tokens, uneven=True)
    out, x = tensor_core_product(matrix, tokens, seed=tokens, steps=steps)
    assert relative_error(out, matrix, x) < 2e-3


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tensor_core_spmm_dtypes(dtype):
    matrix = sparse_matrix(200, 3000, 0.4, dtype=dtype, seed=3)
    out, x = tensor_core_product(matrix, 9, seed=3)
    assert relative_error(out, matrix, x) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


@requires_cuda
@pytest.mark.racecheck
def test_tensor_core_spmm_rows_at_window_edges():
    matrix = boundary_matrix(130, 2600).cuda()
    out, x = tensor_core_product(matrix, 7, seed=1)
    assert relative_error(out, matrix, x) < 2e-3
    rows_close = ((out.double() - x.double() @ matrix.double().T).norm(dim=0)
                  <= 2e-3 * (x.double() @ matrix.double().T).norm(dim=0) + 1e-3)
    assert bool(rows_close.all())


@requires_cuda
def test_tensor_core_spmm_every_k_split_and_fixed_order():
    """Every share count gives the product; one share count gives the same bits on every call, and the
    tiles' arrival counters are zero again after each call."""
    cols = 4 * WINDOW + 1
    matrix = sparse_matrix(200, cols, 0.3, seed=5)
    reference = None
    for k_splits in range(1, 6):  # every share count of the 5 windows
        out, x = tensor_core_product(matrix, 6, seed=5, k_splits=k_splits)
        assert relative_error(out, matrix, x) < 2e-3
        again, _ = tensor_core_product(matrix, 6, k_splits=k_splits, x=x)
        assert torch.equal(out, again)
        assert all(int(counters.abs().sum()) == 0 for counters in macko_ops._macko_counters[x.device])
        if reference is not None:
            assert relative_difference(out, reference.double()) < 2e-3
        reference = out


@requires_cuda
def test_tensor_core_spmm_unaligned_x_and_odd_columns():
    """x at an address that is not 16-byte aligned (and K % 8 != 0) is staged element by element."""
    matrix = sparse_matrix(70, 1029, 0.5, seed=8)
    storage = torch.randn(5 * 1029 + 1, device="cuda").half()
    x = storage[1:].view(5, 1029)
    out, _ = tensor_core_product(matrix, 5, x=x)
    assert relative_error(out, matrix, x) < 2e-3
    matrix = sparse_matrix(70, 1032, 0.5, seed=8)
    storage = torch.randn(5 * 1032 + 1, device="cuda").half()
    x = storage[1:].view(5, 1032)
    out, _ = tensor_core_product(matrix, 5, x=x)
    assert relative_error(out, matrix, x) < 2e-3


@requires_cuda
@pytest.mark.parametrize("k_splits", [1, 3])
def test_tensor_core_spmm_accumulates(k_splits):
    cols = 2 * WINDOW + 476  # 3 windows
    matrix = sparse_matrix(100, cols, 0.5, seed=2)
    values, deltas, row_ptr, table = compressed_with_table(matrix)
    x = torch.randn(4, cols, device="cuda").half()
    residual = torch.randn(4, 100, device="cuda").half()
    out = residual.clone()
    ops.macko_tensor_core_spmm(values, deltas, row_ptr, table, x, out, accumulate=True, k_splits=k_splits)
    expected = residual.double() + x.double() @ matrix.double().T
    assert relative_difference(out, expected) < 2e-3


@requires_cuda
def test_tensor_core_spmm_refuses_bad_inputs():
    cols = 2 * WINDOW + 50  # 3 windows
    matrix = sparse_matrix(10, cols, 0.5, seed=1)
    values, deltas, row_ptr, table = compressed_with_table(matrix)
    x = torch.randn(3, cols, device="cuda").half()
    out = torch.empty(3, 10, device="cuda").half()
    with pytest.raises(RuntimeError, match="window_table must be int32"):  # one window short
        ops.macko_tensor_core_spmm(values, deltas, row_ptr, table[:, :1].contiguous(), x, out)
    with pytest.raises(RuntimeError, match="k_splits must be in"):
        ops.macko_tensor_core_spmm(values, deltas, row_ptr, table, x, out, k_splits=4)
    with pytest.raises(FormatError, match="T <= 16"):
        ops.macko_tensor_core_spmm(values, deltas, row_ptr, table, torch.randn(17, cols, device="cuda").half())


@requires_cuda
@pytest.mark.memcheck_skip
def test_tensor_core_spmm_opcheck():
    cols = 2 * WINDOW + 50  # 3 windows
    matrix = sparse_matrix(70, cols, 0.3, seed=4)
    values, deltas, row_ptr, table = compressed_with_table(matrix)
    x = torch.randn(6, cols, device="cuda", dtype=torch.float16)
    out = torch.empty(6, 70, device="cuda", dtype=torch.float16)
    tiles = -(-70 // ops.MACKO_TILE_ROWS)
    counters = torch.zeros(tiles, dtype=torch.int32, device="cuda")
    partials = torch.empty(3, 16, tiles * ops.MACKO_TILE_ROWS, device="cuda")
    torch.library.opcheck(torch.ops.minfer.macko_tensor_core_spmm,
                          (values, deltas, row_ptr, table, x, out, partials, counters, 3, False))
    torch.library.opcheck(torch.ops.minfer.macko_tensor_core_spmm_tuned,
                          (values, deltas, row_ptr, table, x, out, partials[:0], counters, 1, True, 1))


@requires_cuda
@pytest.mark.parametrize("k_splits", [1, 2])
def test_tensor_core_spmm_cuda_graph_replay_uses_new_inputs(k_splits):
    matrix = sparse_matrix(300, 1500, 0.5, seed=6)
    values, deltas, row_ptr, table = compressed_with_table(matrix)
    x = torch.randn(12, 1500, device="cuda", dtype=torch.float16)
    out = torch.empty(12, 300, device="cuda", dtype=torch.float16)
    assert_graph_replays_read_new_inputs(
        lambda: ops.macko_tensor_core_spmm(values, deltas, row_ptr, table, x, out, k_splits=k_splits), matrix, x, out)


@requires_cuda
@pytest.mark.parametrize("tokens", [ops.MACKO_TENSOR_CORE_MIN_TOKENS - 1, ops.MACKO_TENSOR_CORE_MIN_TOKENS, 16])
def test_weight_takes_the_tensor_cores_from_their_token_count(tokens):
    matrix = sparse_matrix(96, 1300, 0.5, seed=tokens)
    weight = MackoWeight.from_dense(matrix)
    x = torch.randn(tokens, 1300, device="cuda", dtype=torch.float16)
    residual = torch.randn(tokens, 96, device="cuda", dtype=torch.float16)
    expected = residual.double() + x.double() @ matrix.double().T
    assert relative_error(weight(x), matrix, x) < 2e-3
    assert relative_difference(weight.project(x, residual=residual.clone()), expected) < 2e-3
    assert (weight._window_table is not None) == ops.macko_uses_tensor_cores(tokens)


@requires_cuda
def test_weight_builds_its_table_outside_graph_capture_and_again_after_a_load():
    """Even and odd columns: the same entry counts (so load_state_dict fits the buffers), other tables."""
    even, odd = torch.zeros(64, 1300, device="cuda"), torch.zeros(64, 1300, device="cuda")
    even[:, 0::2], odd[:, 1::2] = torch.randn(64, 650, device="cuda"), torch.randn(64, 650, device="cuda")
    even, odd = even.half(), odd.half()
    weight = MackoWeight.from_dense(even)
    x = torch.randn(10, 1300, device="cuda", dtype=torch.float16)
    with pytest.raises(FormatError, match="before capturing"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            weight(x)
    assert relative_error(weight(x), even, x) < 2e-3
    weight.load_state_dict(MackoWeight.from_dense(odd).state_dict())
    assert relative_error(weight(x), odd, x) < 2e-3
