"""2:4 semi-structured sparse weights (docs/FORMATS.md, "2:4"): at most 2 nonzeros in every group of 4
consecutive columns of a row, stored as the 2 kept values of each group and a 4-bit metadata nibble.

Decode (1..16 tokens) runs the sparse24 GEMV, which fuses the norm, the MLP activation and the residual add
as the dense GEMV does. Prefill from GEMM_MIN_TOKENS tokens runs the sparse tensor-core GEMM (ops.sparse24_gemm,
sm_90, K % 64 == 0, N % 8 == 0). The GEMV and the GEMM each read the metadata in their own order: two derived
copies, each built from `meta` at the first call that needs it and rebuilt when `meta` changes (counted in nbytes
once built). Elsewhere prefill decompresses blocks of rows into the scratch buffer MACKO's prefill shares and
runs dense matmuls, so no dense copy is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .. import ops
from ..errors import FormatError
from .base import WeightFormat, WeightStats, expect_tensors, register
from .macko import prefill_row_blocks, scratch_matrix

DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the kernels take the 16-bit ones
BLOCK_ELEMENTS = 1 << 24  # compress this many matrix elements at a time (bounds the temporaries)
# Every input the GEMV does not take goes to the sparse GEMM (where it runs): it timed faster than decompression
# + cuBLAS from 256 tokens on, on all five Llama-2-7B shapes (docs/perf-notes.md, 2026-11-28). None turns it off.
GEMM_MIN_TOKENS: int | None = 17


def compress(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The `values` [R, ceil(C / 32) * 16] and `meta` [R, ceil(C / 32)] int32 of a 2:4 matrix [R, C].

    Columns are padded with zeros to a multiple of 32. Each group keeps its nonzero positions, filled up
    to two with its lowest zero positions, in increasing order. Raises FormatError naming the first group
    with more than 2 nonzeros (-0.0 counts as zero, NaN as nonzero)."""
    if weight.dim() != 2:
        raise FormatError(f"2:4 compresses 2-D [out, in] matrices, got shape {tuple(weight.shape)}")
    if weight.dtype not in DTYPES:
        raise FormatError(f"2:4 stores float16, bfloat16 or float32 values, got {weight.dtype}")
    rows, cols = weight.shape
    padded = -(-cols // ops.SPARSE24_CHUNK_COLS) * ops.SPARSE24_CHUNK_COLS
    values = weight.new_empty(rows, padded // 2)
    meta = torch.empty(rows, padded // ops.SPARSE24_CHUNK_COLS, dtype=torch.int32, device=weight.device)
    slot = torch.arange(4, device=weight.device)
    nibble_shift = 4 * torch.arange(8, device=weight.device)
    block_rows = max(1, BLOCK_ELEMENTS // max(padded, 1))
    for first in range(0, rows if cols else 0, block_rows):
        block = weight[first:first + block_rows]
        w = torch.nn.functional.pad(block, (0, padded - cols)).view(block.shape[0], padded // 4, 4)
        nonzero = w != 0
        counts = nonzero.sum(dim=-1)
        if bool((counts > 2).any()):
            row, group = divmod(int((counts > 2).flatten().nonzero()[0]), padded // 4)
            last = min(4 * group + 3, cols - 1)
            raise FormatError(f"not a 2:4 matrix: row {first + row}, columns {4 * group}..{last} "
                              f"hold {int(counts[row, group])} nonzeros (at most 2 of every 4); prune it to 2:4 first "
                              "(--sparse 2:4 does)")
        # nonzero slots sort first (keys 0..3), then zero slots (4..7); the two smallest, in slot order
        kept = (slot + 4 * ~nonzero).topk(2, dim=-1, largest=False).indices.sort(dim=-1).values
        values[first:first + block_rows] = w.gather(-1, kept).view(w.shape[0], -1)
        nibbles = (kept[..., 0] | (kept[..., 1] << 2)).view(w.shape[0], -1, 8)
        words = (nibbles << nibble_shift).sum(dim=-1)  # < 2^32: the int32 view's bits
        meta[first:first + block_rows] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return values, meta


@register
class Sparse24Weight(WeightFormat):
    """An [N, K] 2:4 matrix as buffers `values` (the kept entries) and `meta` (their positions)."""

    name = "2:4"
    aliases = ("sparse24",)
    structure = (2, 4)
    TENSORS = ("values", "meta")

    def __init__(self, values: torch.Tensor, meta: torch.Tensor, shape: tuple[int, int]):
        rows, cols = shape
        chunks = -(-cols // ops.SPARSE24_CHUNK_COLS)
        if values.dtype not in DTYPES or values.shape != (rows, chunks * ops.SPARSE24_CHUNK_COLS // 2):
            raise FormatError(f"2:4 values of a {rows}x{cols} matrix are a float tensor "
                              f"[{rows}, {chunks * ops.SPARSE24_CHUNK_COLS // 2}], got {values.dtype} "
                              f"{tuple(values.shape)}")
        if meta.dtype != torch.int32 or meta.shape != (rows, chunks):
            raise FormatError(f"2:4 meta of a {rows}x{cols} matrix is int32 [{rows}, {chunks}], got {meta.dtype} "
                              f"{tuple(meta.shape)}")
        if values.device != meta.device:
            raise FormatError("2:4 values and meta must be on one device")
        super().__init__(rows, cols)
        self.register_buffer("values", values)
        self.register_buffer("meta", meta)
        # the kernels' orders of `meta` by builder (ops.sparse24_gemv_metadata, ops.sparse24_gemm_metadata): the
        # copy and which `meta` it was built from
        self._meta_copies: dict[Callable[[torch.Tensor], torch.Tensor], tuple[tuple, torch.Tensor]] = {}

    def _meta_copy(self, build: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`build(meta)`, made once per device and contents of `meta` (a loader fills buffers in place, `.to()`
        moves them)."""
        source = (self.meta.device, self.meta.data_ptr(), self.meta._version)
        built = self._meta_copies.get(build)
        if built is None or built[0] != source:
            built = self._meta_copies[build] = (source, build(self.meta))
        return built[1]

    def gemv_metadata(self) -> torch.Tensor:
        """`meta` in the decode GEMV's order (ops.sparse24_gemv_metadata)."""
        return self._meta_copy(ops.sparse24_gemv_metadata)

    def gemm_metadata(self) -> torch.Tensor:
        """`meta` in the prefill GEMM's order (ops.sparse24_gemm_metadata)."""
        return self._meta_copy(ops.sparse24_gemm_metadata)

    @property
    def nbytes(self) -> int:
        """The buffers, plus the kernels' metadata copies once a decode or a prefill has built them."""
        return super().nbytes + sum(copy.numel() * copy.element_size() for _, copy in self._meta_copies.values())

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> Sparse24Weight:
        return cls(*compress(weight), shape=tuple(weight.shape))

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int],
                     options: Mapping[str, object]) -> Sparse24Weight:
        expect_tensors(cls, tensors, cls.TENSORS)
        return cls(tensors["values"], tensors["meta"], shape=tuple(shape))

    def check(self) -> None:
        ops.check_sparse24_arrays(self.values, self.meta, self.in_features)

    def to_dense(self) -> torch.Tensor:
        return ops.sparse24_decompress(self.values, self.meta, self.in_features)

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    def _runs_kernels(self, x: torch.Tensor) -> bool:
        return x.dtype == self.values.dtype and x.dtype in (torch.float16, torch.bfloat16) and ops.use_kernels(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        tokens = flat.shape[0]
        if self._runs_kernels(x) and 1 <= tokens <= ops.SPARSE24_GEMV_MAX_TOKENS:
            out = ops.sparse24_gemv(flat, self.values, self.meta, self.gemv_metadata())
        elif self._runs_kernels(x) and tokens > 0:
            out = self._prefill(flat.contiguous())
        else:
            out = ops.linear_reference(flat, self.to_dense())
        return out.view(*x.shape[:-1], self.out_features)

    def _prefill(self, flat: torch.Tensor) -> torch.Tensor:
        """Long inputs: the sparse GEMM where it is on and runs, else decompress a block of rows at a time into
        MACKO's scratch buffer and multiply it with cuBLAS, so the scratch stays at macko.PREFILL_SCRATCH_ELEMENTS."""
        rows, cols = self.shape
        gemm_on = GEMM_MIN_TOKENS is not None and flat.shape[0] >= GEMM_MIN_TOKENS
        if gemm_on and ops.sparse24_gemm_takes(flat, rows, cols):
            return ops.sparse24_gemm(flat, self.values, self.gemm_metadata())
        out = torch.empty(flat.shape[0], rows, dtype=flat.dtype, device=flat.device)
        for first, last in prefill_row_blocks(rows, cols):
            weight = scratch_matrix(last - first, cols, self.values.dtype, flat.device)
            ops.sparse24_decompress(self.values[first:last], self.meta[first:last], cols, out=weight)
            torch.mm(flat, weight.T, out=out[:, first:last])
        return out

    def project(self, x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                residual: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
        """Decode runs the norm, the MLP activation and the residual add inside the sparse GEMV."""
        tokens = x.numel() // max(self.in_features, 1)
        if not (self._runs_kernels(x) and 1 <= tokens <= ops.SPARSE24_GEMV_MAX_TOKENS
                and not (silu_mul and residual is not None)):
            return super().project(x, norm_weight, eps, residual, silu_mul)
        flat = x.reshape(tokens, self.in_features)
        adds_in_place = residual is not None and residual.is_contiguous()
        y = ops.sparse24_gemv(flat, self.values, self.meta, self.gemv_metadata(),
                              residual.view(tokens, -1) if adds_in_place else None, norm_weight=norm_weight, eps=eps,
                              accumulate=adds_in_place, silu_mul=silu_mul)
        if adds_in_place:
            return residual
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if residual is None else residual.add_(y)

    def stats(self) -> WeightStats:
        """Nonzeros counted in the kept values (padding columns hold zeros); a row outgrows dense only when
        its padding to 32 columns does (narrow matrices)."""
        rows, cols = self.shape
        value_bytes = self.values.element_size()
        row_bytes = self.values.shape[1] * value_bytes + self.meta.shape[1] * self.meta.element_size()
        return WeightStats(rows * cols, int(torch.count_nonzero(self.values)), self.nbytes, rows * cols * value_bytes,
                           rows if row_bytes > cols * value_bytes else 0)
