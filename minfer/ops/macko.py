"""MACKO-16-4 sparse matrices (kernels/macko; docs/FORMATS.md): the array checks and decoding helpers
(nibble unpacking, the tensor-core SpMM's window table), the SpMV/SpMM, the tensor-core SpMM and
decompression, each with its reference."""

from __future__ import annotations

import torch

from ..errors import FormatError
from .dense import linear_reference
from .elementwise import rms_norm
from .elementwise import silu_mul as silu_mul_op
from .runtime import fake_impl, use_kernels

MACKO_SPMM_MAX_TOKENS = 16  # kernels/macko/macko.h: up to 16 tokens share one pass over the weights


def unpack_nibbles(deltas: torch.Tensor, stored: int) -> torch.Tensor:
    """The first `stored` nibbles of a packed MACKO deltas array (low nibble first), one per uint8."""
    return torch.stack((deltas & 15, deltas >> 4), dim=1).reshape(-1)[:stored]


def _macko_entry_columns(nibbles: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every stored entry: entry k of a row sits one column after entry k-1 plus its
    own nibble (the first at its nibble). `starts` [rows + 1] are the rows' first entries (from 0)."""
    ends = torch.cat((starts.new_zeros(1), (nibbles.long() + 1).cumsum(0)))  # ends[k]: columns used by entries < k
    rows = starts.numel() - 1
    row_of = torch.repeat_interleave(torch.arange(rows, device=starts.device), starts.diff(), output_size=nibbles.numel())
    return row_of, ends[1:] - 1 - ends[starts[:-1]][row_of]


_MACKO_BLOCK_ENTRIES = 1 << 24  # entries the vectorized MACKO helpers handle at once (bounds the temporaries)


def _check_macko_extent(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor) -> int:
    if row_ptr.numel() == 0:
        raise FormatError("row_ptr must hold rows + 1 offsets, got an empty tensor")
    stored = int(row_ptr[-1])
    if stored > values.numel() or 2 * deltas.numel() < stored:
        raise FormatError(f"row_ptr ends at {stored} entries but values holds {values.numel()} "
                          f"and deltas {2 * deltas.numel()}: the MACKO arrays are inconsistent")
    if int(row_ptr[0]) != 0 or bool((row_ptr.diff() < 0).any()):
        raise FormatError("row_ptr must start at 0 and never decrease: the MACKO arrays are inconsistent")
    return stored


def _row_blocks(starts: torch.Tensor, cols: int):
    """(first row, its block's bounds = starts[first:last + 1], first entry, end entry) for blocks of rows
    that together hold at most _MACKO_BLOCK_ENTRIES entries when valid (a row stores at most
    cols + cols // 15: its columns plus a pad per 16-column gap)."""
    block_rows = max(1, _MACKO_BLOCK_ENTRIES // (cols + cols // 15 + 1))
    for first in range(0, starts.numel() - 1, block_rows):
        bounds = starts[first:first + block_rows + 1]
        yield first, bounds, int(bounds[0]), int(bounds[-1])


def check_macko_arrays(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor, cols: int) -> None:
    """Raise FormatError unless the arrays encode a matrix of `cols` columns: row_ptr from 0, never
    decreasing, within values and deltas, and every row's entries inside the columns. Loaders run it
    on every file's arrays, since the kernels trust them. In blocks of rows (bounded temporaries)."""
    kinds = (("values", values, "a float", values.is_floating_point()),
             ("deltas", deltas, "a uint8", deltas.dtype == torch.uint8),
             ("row_ptr", row_ptr, "an int32 or int64", row_ptr.dtype in (torch.int32, torch.int64)))
    for name, array, wanted, kind_ok in kinds:
        if array.dim() != 1 or not kind_ok:
            raise FormatError(f"MACKO {name} must be {wanted} 1-D tensor, got {array.dtype} of shape "
                              f"{tuple(array.shape)}")
    stored = _check_macko_extent(values, deltas, row_ptr)
    nibbles = unpack_nibbles(deltas, stored)
    for _, bounds, begin, end in _row_blocks(row_ptr.long(), cols):
        used = torch.cat((bounds.new_zeros(1), (nibbles[begin:end].long() + 1).cumsum(0)))
        spans = used[bounds[1:] - begin] - used[bounds[:-1] - begin]  # columns each row's entries reach
        if spans.numel() and int(spans.max()) > cols:
            raise FormatError(f"the MACKO arrays place an entry past column {cols - 1}; they do not encode "
                              f"a matrix with {cols} columns")


def _check_macko_columns(col_of: torch.Tensor, cols: int) -> None:
    if col_of.numel() and int(col_of.max()) >= cols:
        raise FormatError(f"the MACKO arrays place an entry past column {cols - 1}; they do not encode "
                          f"a matrix with {cols} columns")


def macko_decompress_reference(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor,
                               cols: int) -> torch.Tensor:
    """The dense [rows, cols] matrix of a MACKO-16-4 triple (docs/FORMATS.md), vectorized."""
    stored = _check_macko_extent(values, deltas, row_ptr)
    row_of, col_of = _macko_entry_columns(unpack_nibbles(deltas, stored), row_ptr.long())
    _check_macko_columns(col_of, cols)
    dense = values.new_zeros(row_ptr.numel() - 1, cols)
    dense[row_of, col_of] = values[:stored]
    return dense


MACKO_WINDOW_COLS = 1024  # kernels/macko/macko.h, kMackoWindowCols
MACKO_TILE_ROWS = 32  # kernels/macko/macko.h, kMackoTileRows
MACKO_TENSOR_CORE_MAX_COLS = 1 << 23  # kernels/macko/macko.h, kMackoTensorCoreMaxCols
_ORIGIN_BIAS = 15  # kernels/macko/macko.h: a run's origin, -15 to 112, is stored plus this


def macko_window_table(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor, cols: int) -> torch.Tensor:
    """The tensor-core SpMM's window table (kernels/macko/macko.h), int32 [rows, windows - 1] on row_ptr's device.

    For each column window w = 1.. of MACKO_WINDOW_COLS columns, row r's run of that window starts at entry
    P = the row's first entry in or past the window, rounded up to a whole 8-entry chunk of the values array
    (at most the row's end), so that runs split no chunk. The entry is (P - the row's first entry) << 7 |
    (origin + 15), where origin = P's column - its nibble - the window's first column (-15 to 112; 0 when P
    is the row's end). Vectorized, in blocks of rows."""
    stored = _check_macko_extent(values, deltas, row_ptr)
    if cols > MACKO_TENSOR_CORE_MAX_COLS:
        raise FormatError(f"the tensor-core SpMM takes at most {MACKO_TENSOR_CORE_MAX_COLS} columns, got {cols}")
    rows = row_ptr.numel() - 1
    windows = max(1, -(-cols // MACKO_WINDOW_COLS))
    table = torch.full((rows, windows - 1), _ORIGIN_BIAS, dtype=torch.int32, device=row_ptr.device)
    if windows == 1 or stored == 0:
        return table
    starts = row_ptr.long()
    nibbles = unpack_nibbles(deltas, stored)
    window_starts = torch.arange(1, windows, device=row_ptr.device) * MACKO_WINDOW_COLS
    for first, bounds, begin, end in _row_blocks(starts, cols):
        if begin == end:
            continue
        row_starts, row_ends = bounds[:-1, None], bounds[1:, None]
        block_nibbles = nibbles[begin:end].long()
        row_of, col_of = _macko_entry_columns(block_nibbles, bounds - begin)
        _check_macko_columns(col_of, cols)
        # (row, window) keys are sorted (rows in order, columns rising): the first entry from window w on
        # is where key (row, w) would go
        keys = row_of * windows + col_of // MACKO_WINDOW_COLS
        block_rows_here = torch.arange(bounds.numel() - 1, device=keys.device)[:, None]
        inside = begin + torch.searchsorted(keys, block_rows_here * windows + window_starts // MACKO_WINDOW_COLS)
        run_start = torch.minimum((inside + 7) & ~7, row_ends)  # absolute: chunks are 8-entry aligned
        at = (run_start - begin).clamp(max=end - begin - 1)
        origin = torch.where(run_start < row_ends, col_of[at] - block_nibbles[at] - window_starts, 0)
        table[first:first + bounds.numel() - 1] = (((run_start - row_starts) << 7) | (origin + _ORIGIN_BIAS)).to(torch.int32)
    return table


def macko_spmv_reference(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor, x: torch.Tensor,
                         residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                         eps: float = 0.0, silu_mul: bool = False) -> torch.Tensor:
    """x [T, K] @ W.T with W decompressed, in fp32, with the fusions of `linear_reference` (the norm,
    the residual add, silu(gate) * up): the CPU path and the oracle."""
    weight = macko_decompress_reference(values, deltas, row_ptr, x.shape[-1])
    return linear_reference(x, weight, norm_weight, eps, residual, silu_mul)


MACKO_FUSED_MAX_COLS = 16384  # kernels/macko/macko.h, kMackoFusedMaxCols


@fake_impl("minfer::macko_spmv")
def _macko_spmv_fake(values, deltas, row_ptr, x, out, norm_weight, eps, accumulate, silu_mul):
    return None


@fake_impl("minfer::macko_spmv_tuned")
def _macko_spmv_tuned_fake(values, deltas, row_ptr, x, out, norm_weight, eps, accumulate, silu_mul, steps,
                           warps_per_block, x_in_smem, pipeline):
    return None


@fake_impl("minfer::macko_tensor_core_spmm")
def _macko_tensor_core_spmm_fake(values, deltas, row_ptr, window_table, x, out, partials, counters, k_splits,
                                 accumulate):
    return None


@fake_impl("minfer::macko_tensor_core_spmm_tuned")
def _macko_tensor_core_spmm_tuned_fake(values, deltas, row_ptr, window_table, x, out, partials, counters, k_splits,
                                       accumulate, steps):
    return None


@fake_impl("minfer::macko_decompress")
def _macko_decompress_fake(values, deltas, row_ptr, out):
    return None


MACKO_TENSOR_CORE_MIN_TOKENS = 9  # up to 8 tokens the CUDA-core SpMM is faster (docs/perf-notes.md)
MACKO_TENSOR_CORE_BLOCKS_PER_SM = 2  # kernels/macko/macko_tensor_core_spmm.cu: two 512-thread blocks fit an SM


def macko_uses_tensor_cores(tokens: int) -> bool:
    """Whether macko_spmv runs `tokens` tokens on the tensor cores when given a window table."""
    return MACKO_TENSOR_CORE_MIN_TOKENS <= tokens <= MACKO_SPMM_MAX_TOKENS


def macko_k_splits(rows: int, cols: int, device: torch.device) -> int:
    """Shares of the column windows for the tensor-core SpMM, in equal shares of whole windows: about
    one block per block slot of the GPU (a 4096-row matrix has 128 tiles of rows: 2 shares on 132 SMs).
    The nearest share count, not the next larger one: each share adds partial sums, a merge and a spill
    product, and on an H100 4096 x 11008 took 56 us with 2 shares against 65 us with 3; matrices of at
    least one block per slot take 1 (12288 x 4096: 59 us against 64 us with 2; docs/perf-notes.md)."""
    windows = max(1, -(-cols // MACKO_WINDOW_COLS))
    tiles = max(1, -(-rows // MACKO_TILE_ROWS))
    slots = MACKO_TENSOR_CORE_BLOCKS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    wanted = max(1, min(windows, round(slots / tiles)))
    per_share = -(-windows // wanted)
    return -(-windows // per_share)


_macko_counters: dict[torch.device, list[torch.Tensor]] = {}


def _macko_tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The arrival counters of the k-split SpMM's tiles: zero at rest (every launch leaves them zero). A
    larger matrix gets a larger buffer; the smaller ones stay allocated, since CUDA graphs captured
    earlier keep their addresses."""
    buffers = _macko_counters.setdefault(device, [])
    if not buffers or buffers[-1].numel() < tiles:
        buffers.append(torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device))
    return buffers[-1]




def macko_tensor_core_spmm(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor,
                           window_table: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None, *,
                           accumulate: bool = False, k_splits: int = 0) -> torch.Tensor:
    """out [T, N] (+)= x [T, K] @ W.T for up to 16 tokens on the tensor cores (kernels/macko/macko.h), given
    the matrix's macko_window_table. `k_splits` shares of the column windows (0: macko_k_splits) run in
    parallel and are added in a fixed order. Launches on one device share arrival counters, so calls
    from several streams at once are not supported."""
    return _macko_tensor_core_spmm(values, deltas, row_ptr, window_table, x, out, accumulate, k_splits, None)


def macko_tensor_core_spmm_tuned(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor,
                                 window_table: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None, *,
                                 accumulate: bool = False, k_splits: int = 0, steps: int = 0) -> torch.Tensor:
    """macko_tensor_core_spmm with the warp steps per load group pinned: `steps` 1 or 2 (0: the tuned
    default), for benchmarks."""
    return _macko_tensor_core_spmm(values, deltas, row_ptr, window_table, x, out, accumulate, k_splits, steps)


def _macko_tensor_core_spmm(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor,
                            window_table: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None, accumulate: bool,
                            k_splits: int, steps: int | None) -> torch.Tensor:
    if accumulate and out is None:
        raise FormatError("macko_tensor_core_spmm(accumulate=True) adds into `out`: pass the tensor to add into")
    rows = row_ptr.numel() - 1
    if out is None:
        out = x.new_empty(x.shape[0], rows)
    if not use_kernels(x):
        out.copy_(macko_spmv_reference(values, deltas, row_ptr, x, out if accumulate else None))
        return out
    if x.dim() != 2 or x.shape[0] > MACKO_SPMM_MAX_TOKENS:
        raise FormatError(f"macko_tensor_core_spmm takes x [T, K] with T <= {MACKO_SPMM_MAX_TOKENS}, got {tuple(x.shape)}")
    splits = k_splits or macko_k_splits(rows, x.shape[1], x.device)
    tiles = -(-rows // MACKO_TILE_ROWS)
    partials = (torch.empty(splits, MACKO_SPMM_MAX_TOKENS, tiles * MACKO_TILE_ROWS, dtype=torch.float32,
                            device=x.device) if splits > 1 else x.new_empty(0, dtype=torch.float32))
    args = (values, deltas, row_ptr, window_table, x, out, partials, _macko_tile_counters(x.device, tiles), splits,
            accumulate)
    if steps is None:
        torch.ops.minfer.macko_tensor_core_spmm(*args)
    else:
        torch.ops.minfer.macko_tensor_core_spmm_tuned(*args, steps)
    return out


def macko_spmv(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor, x: torch.Tensor,
               out: torch.Tensor | None = None, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               accumulate: bool = False, silu_mul: bool = False,
               window_table: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, N] = x [T, K] @ W.T for a MACKO matrix W [N, K] (N = row_ptr.numel() - 1); with
    `accumulate`, out += x @ W.T in place (the residual add of a Llama sublayer); with `norm_weight`
    g [K], x is replaced by its RMSNorm times g (eps as in the model); with `silu_mul`, W is the MLP's
    [gate; up] and out [T, N / 2] = silu(gate) * up.

    One kernel pass reads the compressed weights once for up to 16 tokens (more tokens take more
    passes; prefill should decompress instead). The kernel fuses the norm and silu_mul for one token
    of up to MACKO_FUSED_MAX_COLS columns (decode); other inputs run the rms_norm kernel before and the
    silu_mul kernel after. With the matrix's `window_table` (macko_window_table), MACKO_TENSOR_CORE_MIN_TOKENS
    to 16 tokens run the tensor-core SpMM instead."""
    return _macko_spmv(values, deltas, row_ptr, x, out, norm_weight, eps, accumulate, silu_mul, window_table, None)


def macko_spmv_tuned(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor, x: torch.Tensor,
                     out: torch.Tensor | None = None, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                     accumulate: bool = False, silu_mul: bool = False, window_table: torch.Tensor | None = None,
                     steps: int = 0, warps_per_block: int = 0, x_in_smem: int = -1, pipeline: int = 1) -> torch.Tensor:
    """macko_spmv with the SpMV kernel's launch knobs pinned (kernels/macko/macko.h, MackoTuning), for
    benchmarks: the defaults (0, 0, -1) of `steps`, `warps_per_block`, `x_in_smem` pick the tuned
    configuration; `pipeline=0` runs the reference kernel's schedule (one step loaded then decoded, x
    gathered from global memory)."""
    return _macko_spmv(values, deltas, row_ptr, x, out, norm_weight, eps, accumulate, silu_mul, window_table,
                       (steps, warps_per_block, x_in_smem, pipeline))


def _macko_spmv(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor, x: torch.Tensor,
                out: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float, accumulate: bool,
                silu_mul: bool, window_table: torch.Tensor | None,
                tuning: tuple[int, int, int, int] | None) -> torch.Tensor:
    if accumulate and out is None:
        raise FormatError("macko_spmv(accumulate=True) adds into `out`: pass the tensor to add into")
    if norm_weight is not None and norm_weight.shape != (x.shape[-1],):
        raise FormatError(f"macko_spmv: norm_weight must be [{x.shape[-1]}] for x {tuple(x.shape)}, "
                          f"got {tuple(norm_weight.shape)}")
    rows = row_ptr.numel() - 1
    if silu_mul and (rows % 2 or accumulate):
        raise FormatError(f"macko_spmv(silu_mul=True) needs W = [gate; up] with an even N (got {rows}) and no accumulate")
    if out is None:
        out = x.new_empty(x.shape[0], rows // 2 if silu_mul else rows)
    if use_kernels(x):
        tensor_cores = window_table is not None and macko_uses_tensor_cores(x.shape[0])
        _, _, x_in_smem, pipeline = tuning or (0, 0, -1, 1)
        fuses = (x.shape[0] == 1 and x.shape[1] <= MACKO_FUSED_MAX_COLS and pipeline != 0 and x_in_smem != 0
                 and not tensor_cores)
        if norm_weight is not None and not fuses:
            x, norm_weight = rms_norm(x, norm_weight, eps), None
        spmv_out = x.new_empty(x.shape[0], rows) if silu_mul and not fuses else out
        if tensor_cores:
            macko_tensor_core_spmm(values, deltas, row_ptr, window_table, x, spmv_out, accumulate=accumulate)
        elif tuning is None:
            torch.ops.minfer.macko_spmv(values, deltas, row_ptr, x, spmv_out, norm_weight, eps, accumulate,
                                        silu_mul and fuses)
        else:
            torch.ops.minfer.macko_spmv_tuned(values, deltas, row_ptr, x, spmv_out, norm_weight, eps, accumulate,
                                              silu_mul and fuses, *tuning)
        if spmv_out is not out:
            silu_mul_op(spmv_out, out)
    else:
        out.copy_(macko_spmv_reference(values, deltas, row_ptr, x, out if accumulate else None, norm_weight, eps,
                                       silu_mul))
    return out


def macko_decompress(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor,
                     out: torch.Tensor | None = None, cols: int | None = None) -> torch.Tensor:
    """The dense [N, K] matrix of a MACKO triple, written into `out` (or a new [N, cols] tensor)."""
    if out is None:
        if cols is None:
            raise ValueError("macko_decompress needs `out` or `cols`")
        out = values.new_empty(row_ptr.numel() - 1, cols)
    if use_kernels(values):
        torch.ops.minfer.macko_decompress(values, deltas, row_ptr, out)
    else:
        out.copy_(macko_decompress_reference(values, deltas, row_ptr, out.shape[1]))
    return out
