"""MACKO-16-4 unstructured sparse weights (docs/FORMATS.md).

`compress` turns a dense matrix into the reference library's three arrays (macko_spmv v0.2.0),
array for array, vectorized in torch on the matrix's device. `MackoWeight` keeps them as buffers
and multiplies with the SpMV/SpMM kernel for up to 8 tokens (decode, batched decode) and the
tensor-core SpMM for 9-16 (speculative verification; it needs a window table, built on first use).
Longer inputs (prefill) decompress blocks of rows into one 64 MB scratch buffer
shared by every MACKO layer and run dense matmuls, so no dense copy of the model is ever kept.
`MackoWeight.from_reference` imports the checkpoints of macko_spmv's compression script.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .. import ops
from ..errors import CheckpointError, FormatError
from .base import WeightFormat, WeightStats, expect_tensors, register

MAX_SKIP = 15  # a 4-bit nibble: after 15 skipped zeros an explicit zero is stored
ALIGN = 8  # values are padded to a multiple of 8 entries (one 16-byte load)
BLOCK_ELEMENTS = 1 << 24  # compress this many matrix elements at a time (bounds the temporaries)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the kernels take the 16-bit ones

MackoArrays = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # values, deltas, row_ptr


def _pack(values: torch.Tensor, nibbles: torch.Tensor, counts: torch.Tensor) -> MackoArrays:
    """Stored entries (row-major) and their nibbles -> padded values, packed deltas, row_ptr."""
    stored = values.numel()
    if stored >= 2**31:
        raise FormatError(f"a MACKO matrix holds at most 2^31 - 1 entries, this one needs {stored}; split it")
    pad = -stored % ALIGN
    values = torch.cat((values, values.new_zeros(pad)))
    nibbles = torch.cat((nibbles.to(torch.uint8), nibbles.new_zeros(pad, dtype=torch.uint8)))
    deltas = nibbles[0::2] | (nibbles[1::2] << 4)  # entry i in byte i // 2, low nibble first
    row_ptr = torch.cat((counts.new_zeros(1), counts.cumsum(0))).to(torch.int32)
    return values, deltas, row_ptr


def compress(weight: torch.Tensor) -> MackoArrays:
    """MACKO arrays of a dense [R, C] matrix, identical to the reference compressor (which is fp16).

    Per row, walking left to right: a nonzero is stored, and so is a zero that follows 15 skipped
    zeros; stored zeros after the row's last nonzero are dropped. A stored entry's nibble counts
    the columns skipped since the previous stored entry. -0.0 counts as zero; NaN as nonzero.
    """
    if weight.dim() != 2:
        raise FormatError(f"MACKO compresses 2-D [out, in] matrices, got shape {tuple(weight.shape)}")
    if weight.dtype not in DTYPES:
        raise FormatError(f"MACKO stores float16, bfloat16 or float32 values, got {weight.dtype}")
    weight = weight.contiguous()  # the flat indices below are row-major
    rows, cols = weight.shape
    column = torch.arange(cols, device=weight.device, dtype=torch.int32)
    values, nibbles, counts = [], [], []
    block_rows = max(1, BLOCK_ELEMENTS // max(cols, 1))
    for first in range(0, rows, block_rows):  # blocks of rows, each one vectorized
        w = weight[first:first + block_rows]
        nonzero = w != 0
        # last nonzero column at or before each column (-1 before the first one)
        last_nonzero = torch.where(nonzero, column, -1).cummax(dim=1).values
        forced = ~nonzero & (((column - last_nonzero) & MAX_SKIP) == 0)  # 16, 32, ... columns after it
        stored = nonzero | (forced & (column < last_nonzero[:, -1:]))
        row_counts = stored.sum(dim=1)
        flat = stored.view(-1).nonzero().squeeze(1)  # row-major order
        stored_col = flat % cols
        previous = torch.roll(stored_col, 1)
        row_starts = (row_counts.cumsum(0) - row_counts)[row_counts > 0]
        previous[row_starts] = -1
        values.append(w.reshape(-1)[flat])
        nibbles.append(stored_col - previous - 1)
        counts.append(row_counts)
    if not values:  # a matrix with no rows
        return _pack(weight.new_zeros(0), column.new_zeros(0), column.new_zeros(0, dtype=torch.long))
    return _pack(torch.cat(values), torch.cat(nibbles), torch.cat(counts))


def concat_rows(parts: list[MackoArrays]) -> MackoArrays:
    """The MACKO arrays of the matrices stacked row-wise (equal to compressing the stacked matrix)."""
    values, nibbles, counts = [], [], []
    for part_values, part_deltas, part_row_ptr in parts:
        stored = int(part_row_ptr[-1])
        values.append(part_values[:stored])
        nibbles.append(ops.unpack_nibbles(part_deltas, stored))
        counts.append(part_row_ptr.diff().long())
    return _pack(torch.cat(values), torch.cat(nibbles), torch.cat(counts))


_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
# Prefill decompresses at most this many weights at once (64 MB in fp16), in equal blocks of rows:
# Llama-2-7B's gate_up (180 MB whole) in three blocks, o_proj whole.
PREFILL_SCRATCH_ELEMENTS = 32 * 1024 * 1024
ROW_ALIGN = 128  # rows


def prefill_row_blocks(rows: int, cols: int) -> list[tuple[int, int]]:
    """The [first, last) row blocks a prefill decompresses one at a time: at most PREFILL_SCRATCH_ELEMENTS
    weights each, about equal (no small last one), starting on whole ROW_ALIGN steps when there are several,
    so the matmuls' output column slices stay aligned."""
    if rows == 0:
        return []
    most = max(1, PREFILL_SCRATCH_ELEMENTS // max(cols, 1))  # rows that fit the scratch
    if most >= ROW_ALIGN:
        most -= most % ROW_ALIGN
    block = -(-rows // -(-rows // most))
    if block < rows and most >= ROW_ALIGN:
        block = min(most, -(-block // ROW_ALIGN) * ROW_ALIGN)
    return [(first, min(rows, first + block)) for first in range(0, rows, block)]


def release_scratch() -> None:
    """Free the decompression buffers (the next prefill allocates them again)."""
    _scratch.clear()


def scratch_matrix(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [rows, cols] view of the one decompression buffer per device and dtype (grown on demand).

    Every MACKO layer decompresses blocks of rows into it before its prefill matmuls; stream order
    keeps each use after the previous matmul. Under CUDA-graph capture the block comes from the graph's
    own pool instead: the shared buffer can be replaced or released while a captured prefill still
    reads its address.
    """
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(rows, cols, dtype=dtype, device=device)
    buffer = _scratch.get((device, dtype))
    if buffer is None or buffer.numel() < rows * cols:
        buffer = torch.empty(rows * cols, dtype=dtype, device=device)
        _scratch[(device, dtype)] = buffer
    return buffer[: rows * cols].view(rows, cols)


@register
class MackoWeight(WeightFormat):
    """An [N, K] matrix as MACKO-16-4 buffers `values`, `deltas`, `row_ptr`."""

    name = "macko"
    reference = ("a checkpoint of macko_spmv's compression script (keys <name>.c_0 ... c_4); config and "
                 "tokenizer come from --model, whose weights are not downloaded")
    TENSORS = ("values", "deltas", "row_ptr")

    def __init__(self, values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor, shape: tuple[int, int]):
        rows, cols = shape
        if values.dim() != 1 or values.dtype not in DTYPES or values.numel() % ALIGN:
            raise FormatError(f"MACKO values must be a 1-D float tensor of a multiple of {ALIGN} "
                              f"entries, got {values.dtype} {tuple(values.shape)}")
        if deltas.dtype != torch.uint8 or deltas.shape != (values.numel() // 2,):
            raise FormatError(f"MACKO deltas must be uint8 with {values.numel() // 2} bytes (one nibble per "
                              f"value), got {deltas.dtype} {tuple(deltas.shape)}")
        if row_ptr.dtype != torch.int32 or row_ptr.shape != (rows + 1,):
            raise FormatError(f"MACKO row_ptr must be int32 with {rows + 1} offsets for {rows} rows, "
                              f"got {row_ptr.dtype} {tuple(row_ptr.shape)}")
        if not values.device == deltas.device == row_ptr.device:
            raise FormatError("MACKO values, deltas and row_ptr must be on one device")
        super().__init__(rows, cols)
        self.register_buffer("values", values)
        self.register_buffer("deltas", deltas)
        self.register_buffer("row_ptr", row_ptr)
        self._window_table: torch.Tensor | None = None

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> MackoWeight:
        return cls(*compress(weight), shape=tuple(weight.shape))

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int],
                     options: Mapping[str, object]) -> MackoWeight:
        expect_tensors(cls, tensors, cls.TENSORS)
        return cls(*(tensors[name] for name in cls.TENSORS), shape=tuple(shape))

    @classmethod
    def from_reference(cls, tensors: Mapping[str, object], parts: list[tuple[str, tuple[int, int]]],
                       where: str) -> MackoWeight:
        """macko_spmv's compression script stores each HF weight `<name>.weight` as `<name>.c_0` ... `.c_4`:
        values, deltas, row_ptr, rows, cols. The parts' rows are stacked (concatenating MACKO rows equals
        compressing the stacked matrix)."""
        arrays = []
        for hf_name, shape in parts:
            keys = [hf_name.removesuffix("weight") + f"c_{i}" for i in range(5)]
            if any(k not in tensors for k in keys):
                raise CheckpointError(f"{where} lacks {next(k for k in keys if k not in tensors)}; the reference "
                                      "compressor stores <name>.c_0 ... .c_4 for every attention and MLP weight")
            rows, cols = (_reference_size(tensors[k], k, where) for k in keys[3:])
            if (rows, cols) != tuple(shape):
                raise CheckpointError(f"{keys[0]} in {where} is {rows}x{cols}, expected {shape[0]}x{shape[1]}")
            part = [tensors[k] for k in keys[:3]]
            if not all(isinstance(a, torch.Tensor) for a in part):
                raise CheckpointError(f"{keys[0]} .. {keys[2]} in {where} must be tensors (values, deltas, row_ptr)")
            try:
                ops.check_macko_arrays(*part, cols)
            except FormatError as exc:
                raise CheckpointError(f"{keys[0]} .. {keys[2]} in {where}: {exc}") from None
            arrays.append(tuple(part))
        rows = sum(shape[0] for _, shape in parts)
        return cls(*concat_rows(arrays), shape=(rows, parts[0][1][1]))

    def check(self) -> None:
        ops.check_macko_arrays(self.values, self.deltas, self.row_ptr, self.in_features)

    def to_dense(self) -> torch.Tensor:
        return ops.macko_decompress(self.values, self.deltas, self.row_ptr, cols=self.in_features)

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        if self.values.dtype == torch.float32:  # no fp32 kernel: the CPU-oriented reference path
            out = ops.macko_spmv_reference(self.values, self.deltas, self.row_ptr, flat)
        elif flat.shape[0] > ops.MACKO_SPMM_MAX_TOKENS and ops.use_kernels(flat):
            out = self._prefill(flat)
        else:
            out = ops.macko_spmv(self.values, self.deltas, self.row_ptr, flat,
                                 window_table=self.window_table_for(flat))
        return out.view(*x.shape[:-1], self.out_features)

    def window_table_for(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The tensor-core SpMM's window table when `flat` [T, K] takes that kernel, else None. Built on
        first use (the arrays must not change after it) and kept: about 0.25% of the format's bytes at
        d = 0.5; decode (one token) and long prefills never build it."""
        if not (ops.use_kernels(flat) and ops.macko_uses_tensor_cores(flat.shape[0])):
            return None
        if self._window_table is None or self._window_table.device != self.values.device:
            if torch.cuda.is_current_stream_capturing():
                raise FormatError(f"a MACKO layer builds its window table on its first call of "
                                  f"{ops.MACKO_TENSOR_CORE_MIN_TOKENS}-{ops.MACKO_SPMM_MAX_TOKENS} tokens, which "
                                  "cannot run inside a CUDA graph capture: make one such call before capturing")
            self._window_table = ops.macko_window_table(self.values, self.deltas, self.row_ptr, self.in_features)
        return self._window_table

    def _load_from_state_dict(self, *args, **kwargs):
        self._window_table = None  # built again from the loaded arrays
        super()._load_from_state_dict(*args, **kwargs)

    def _prefill(self, flat: torch.Tensor) -> torch.Tensor:
        """Long inputs: decompress a block of rows at a time into the shared scratch buffer and
        multiply it on tensor cores, so the scratch stays at PREFILL_SCRATCH_ELEMENTS."""
        rows, cols = self.out_features, self.in_features
        out = torch.empty(flat.shape[0], rows, dtype=flat.dtype, device=flat.device)
        for first, last in prefill_row_blocks(rows, cols):
            weight = scratch_matrix(last - first, cols, self.values.dtype, flat.device)
            ops.macko_decompress(self.values, self.deltas, self.row_ptr[first:last + 1], out=weight)
            torch.mm(flat, weight.T, out=out[:, first:last])
        return out

    def project(self, x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                residual: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
        """Decode runs the norm, the MLP activation (one token) and the residual add inside the SpMV
        kernel (ops.macko_spmv runs the norm and activation kernels where it cannot fuse them)."""
        tokens = x.numel() // max(self.in_features, 1)
        if not (ops.use_kernels(x) and self.values.dtype != torch.float32
                and 1 <= tokens <= ops.MACKO_SPMM_MAX_TOKENS):
            return super().project(x, norm_weight, eps, residual, silu_mul)
        flat = x.reshape(tokens, self.in_features).contiguous()
        adds_in_place = residual is not None and residual.is_contiguous() and not silu_mul
        y = ops.macko_spmv(self.values, self.deltas, self.row_ptr, flat, norm_weight=norm_weight, eps=eps,
                           out=residual.view(tokens, self.out_features) if adds_in_place else None,
                           accumulate=adds_in_place, silu_mul=silu_mul, window_table=self.window_table_for(flat))
        if adds_in_place:
            return residual
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if residual is None else residual.add_(y)

    def stats(self) -> WeightStats:
        """Nonzeros counted in the stored values; a row is larger than dense when its entries (a value and a
        nibble each) plus its row_ptr slot outweigh the dense row."""
        rows, cols = self.shape
        value_bytes = self.values.element_size()
        stored = int(self.row_ptr[-1])
        bytes_x2 = (2 * value_bytes + 1) * self.row_ptr.diff().long() + 2 * self.row_ptr.element_size()
        return WeightStats(rows * cols, int(torch.count_nonzero(self.values[:stored])), self.nbytes,
                           rows * cols * value_bytes, int((bytes_x2 > 2 * cols * value_bytes).sum()))


def _reference_size(value, key: str, where: str) -> int:
    """A matrix size stored by the reference compressor: an int, or a one-element integer tensor."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise CheckpointError(f"{key} in {where} must be an integer (the matrix's rows or columns), "
                          f"got {str(value)[:40]!r}")
