"""2:4 sparse projections (kernels/sparse24): the decode GEMV (1..16 tokens) and decompression, with their
references. The arrays are minfer.formats.sparse24's `values` [R, C32 / 2] and `meta` [R, C32 / 32] int32
(C32: the columns rounded up to a multiple of 32); docs/FORMATS.md gives the layout."""

from __future__ import annotations

import torch

from ..errors import FormatError
from .dense import linear_reference
from .runtime import fake_impl, use_kernels

SPARSE24_CHUNK_COLS = 32  # kernels/sparse24/sparse24.h, kSparse24ChunkCols: the columns of one metadata word
SPARSE24_GEMV_MAX_TOKENS = 16  # kernels/sparse24/sparse24.h, kSparse24MaxTokens: two n = 8 mma tiles


def _kept_slots(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 2-bit slot indices of every group: [R, groups] each, groups = 8 per metadata word."""
    shifts = 4 * torch.arange(8, device=meta.device, dtype=torch.int32)
    nibbles = ((meta.unsqueeze(-1) >> shifts) & 0xF).flatten(1)
    return nibbles & 3, nibbles >> 2


def sparse24_decompress_reference(values: torch.Tensor, meta: torch.Tensor, cols: int) -> torch.Tensor:
    """The dense [R, cols] matrix: group g's kept values values[:, 2g], values[:, 2g + 1] at columns
    4g + slot0 and 4g + slot1."""
    rows = values.shape[0]
    first, second = _kept_slots(meta)
    dense = values.new_zeros(rows, first.shape[1], 4)
    pairs = values.view(rows, first.shape[1], 2)
    dense.scatter_(-1, first.long().unsqueeze(-1), pairs[..., :1])
    dense.scatter_(-1, second.long().unsqueeze(-1), pairs[..., 1:])
    return dense.view(rows, 4 * first.shape[1])[:, :cols]


def check_sparse24_arrays(values: torch.Tensor, meta: torch.Tensor, cols: int) -> None:
    """Raise FormatError unless every group's two slots are distinct and increasing (the kernels' one
    encoding of each pattern) and the padding past `cols` holds zeros."""
    first, second = _kept_slots(meta)
    bad = first >= second
    if bool(bad.any()):
        row, group = divmod(int(bad.flatten().nonzero()[0]), bad.shape[1])
        nibble = int(first[row, group] | (second[row, group] << 2))
        raise FormatError(f"2:4 meta of row {row}, group {group} is {nibble:#06b}: its two slots must be distinct "
                          "and increasing (the low 2 bits the smaller)")
    if values.shape[1] * 2 > cols and bool(sparse24_decompress_reference(values, meta, values.shape[1] * 2)[:, cols:]
                                           .ne(0).any()):
        raise FormatError(f"2:4 values hold nonzeros past the matrix's {cols} columns (the padding must be zero)")


@fake_impl("minfer::sparse24_decompress")
def _decompress_fake(values, meta, out):
    return None


def sparse24_decompress(values: torch.Tensor, meta: torch.Tensor, cols: int,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense [R, cols] matrix of the arrays (into `out` when given: prefill's scratch)."""
    if out is None:
        out = values.new_empty(values.shape[0], cols)
    if use_kernels(values) and values.dtype in (torch.float16, torch.bfloat16) and out.is_contiguous():
        torch.ops.minfer.sparse24_decompress(values, meta, out)
    else:
        out.copy_(sparse24_decompress_reference(values, meta, cols))
    return out


@fake_impl("minfer::sparse24_gemv")
def _gemv_fake(x, values, meta, out, norm_weight=None, eps=0.0, accumulate=False, silu_mul=False):
    return None


def sparse24_gemv(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor, out: torch.Tensor | None = None, *,
                  norm_weight: torch.Tensor | None = None, eps: float = 0.0, accumulate: bool = False,
                  silu_mul: bool = False) -> torch.Tensor:
    """x @ W.T for decode with W the 2:4 arrays' [N, K] matrix: x [T, K] with 1..16 tokens -> [T, N], fp32
    accumulation. The fusions of ops.gemv: `norm_weight` multiplies RMSNorm(x) instead of x; `accumulate` adds
    into `out` in place; `silu_mul` takes W as [gate; up] and returns silu(gate) * up [T, N / 2]."""
    if x.dim() != 2:
        raise FormatError(f"sparse24_gemv takes x [tokens, K], got {tuple(x.shape)}")
    tokens, k = x.shape
    rows = values.shape[0]
    if not 1 <= tokens <= SPARSE24_GEMV_MAX_TOKENS:
        raise FormatError(f"sparse24_gemv takes 1..{SPARSE24_GEMV_MAX_TOKENS} tokens, got {tokens}")
    if values.shape[1] * 2 < k or values.shape[1] * 2 - k >= SPARSE24_CHUNK_COLS:
        raise FormatError(f"sparse24_gemv: x has K={k} but the arrays hold {values.shape[1] * 2} padded columns")
    if accumulate and out is None:
        raise FormatError("sparse24_gemv(accumulate=True) adds into `out`: pass the tensor to add into")
    if silu_mul and (rows % 2 or accumulate):
        raise FormatError(f"sparse24_gemv(silu_mul=True) needs [gate; up] with an even N (got {rows}) "
                          "and no accumulate")
    outputs = rows // 2 if silu_mul else rows
    if out is None:
        out = x.new_empty(tokens, outputs)
    elif out.shape != (tokens, outputs):
        raise FormatError(f"sparse24_gemv: out must be [{tokens}, {outputs}], got {tuple(out.shape)}")
    if use_kernels(x):
        torch.ops.minfer.sparse24_gemv(x.contiguous(), values, meta, out, norm_weight, eps, accumulate, silu_mul)
    else:
        dense = sparse24_decompress_reference(values, meta, k)
        out.copy_(linear_reference(x, dense, norm_weight, eps, out if accumulate else None, silu_mul))
    return out
