"""2:4 sparse projections (kernels/sparse24): the decode GEMV (1..16 tokens), decompression and the prefill GEMM
on Hopper's sparse tensor cores, with their references. The arrays are minfer.formats.sparse24's `values`
[R, C32 / 2] and `meta` [R, C32 / 32] int32 (C32: the columns rounded up to a multiple of 32), and for the GEMV
and the GEMM the same metadata in their own orders (`sparse24_gemv_metadata`, `sparse24_gemm_metadata`);
docs/FORMATS.md gives the layouts."""

from __future__ import annotations


import torch

from ..errors import FormatError
from .dense import linear_reference
from .runtime import fake_impl, is_sm90, use_kernels

SPARSE24_CHUNK_COLS = 32  # kernels/sparse24/sparse24.h, kSparse24ChunkCols: the columns of one metadata word
SPARSE24_GEMV_MAX_TOKENS = 16  # kernels/sparse24/sparse24.h, kSparse24MaxTokens: two n = 8 mma tiles
# kernels/sparse24/sparse24.h: the GEMV metadata's row groups (8 rows: one per lane quad) and warp steps (4 words)
SPARSE24_GEMV_ROW_GROUP = 8
SPARSE24_GEMV_STEP_CHUNKS = 4
# kernels/sparse24/sparse24.h: the GEMM metadata's atom (words), its row padding, and the GEMM's K multiple
SPARSE24_GEMM_ATOM_WORDS = 128
SPARSE24_GEMM_ROW_MULTIPLE = 256
SPARSE24_GEMM_K_MULTIPLE = 64
PADDING_WORD = 0x44444444  # slots 0, 1 in all 8 groups: a valid encoding for padding


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


def _gemv_metadata_shape(rows, words) -> tuple[int, int, int, int]:
    """[R8, S, 8, 4] for `meta` [rows, words] (symbolic sizes too: the fake implementation's)."""
    return ((rows + SPARSE24_GEMV_ROW_GROUP - 1) // SPARSE24_GEMV_ROW_GROUP,
            (words + SPARSE24_GEMV_STEP_CHUNKS - 1) // SPARSE24_GEMV_STEP_CHUNKS, SPARSE24_GEMV_ROW_GROUP,
            SPARSE24_GEMV_STEP_CHUNKS)


@fake_impl("minfer::sparse24_gemv_metadata")
def _gemv_metadata_fake(meta):
    return meta.new_empty(_gemv_metadata_shape(*meta.shape))


def sparse24_gemv_metadata(meta: torch.Tensor) -> torch.Tensor:
    """`meta` [R, W] in the decode GEMV's order: int32 [R8, S, 8, 4] (R8 = ceil(R / 8), S = ceil(W / 4) warp
    steps of 128 columns, padding PADDING_WORD). Word [b, step, g, t] is what lane t of the quad of row 8 b + g
    multiplies at `step`: half t % 2 (bits 16 (t % 2) .. 16 (t % 2) + 15) of word 4 step + t // 2 of the row in
    its low 16 bits, the same half of word 4 step + t // 2 + 2 in its high 16 bits. The kernel on a GPU, tensor
    ops elsewhere (the tests' reference)."""
    if use_kernels(meta):
        return torch.ops.minfer.sparse24_gemv_metadata(meta.contiguous())
    rows, words = meta.shape
    row_groups, steps, group_rows, step_words = _gemv_metadata_shape(rows, words)
    full = torch.full((row_groups * group_rows, steps * step_words), PADDING_WORD, dtype=torch.int64,
                      device=meta.device)
    full[:rows, :words] = meta.to(torch.int64) & 0xFFFFFFFF
    # word 4 step + 2 i + t // 2 of a row holds lane t's piece t (i = 0) or t + 4 (i = 1)
    full = full.view(row_groups, group_rows, steps, 2, step_words // 2)  # b, g, step, i, t // 2
    halves = torch.stack([full & 0xFFFF, full >> 16], dim=-1)  # ..., t % 2
    lanes = halves[:, :, :, 0] | (halves[:, :, :, 1] << 16)  # b, g, step, t // 2, t % 2
    lanes = lanes.permute(0, 2, 1, 3, 4).reshape(row_groups, steps, group_rows, step_words)
    return torch.where(lanes >= 2**31, lanes - 2**32, lanes).to(torch.int32)


@fake_impl("minfer::sparse24_gemv")
def _gemv_fake(x, values, meta, gemv_meta, out, norm_weight=None, eps=0.0, accumulate=False, silu_mul=False):
    return None


def sparse24_gemv(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor, gemv_meta: torch.Tensor,
                  out: torch.Tensor | None = None, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                  accumulate: bool = False, silu_mul: bool = False) -> torch.Tensor:
    """x @ W.T for decode with W the 2:4 arrays' [N, K] matrix: x [T, K] with 1..16 tokens -> [T, N], fp32
    accumulation. The kernel's tensor-core path reads the metadata as `gemv_meta` (`sparse24_gemv_metadata(meta)`),
    its scalar path and the reference as `meta`. The fusions of ops.gemv: `norm_weight` multiplies RMSNorm(x)
    instead of x; `accumulate` adds into `out` in place; `silu_mul` takes W as [gate; up] and returns
    silu(gate) * up [T, N / 2]."""
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
        torch.ops.minfer.sparse24_gemv(x.contiguous(), values, meta, gemv_meta, out, norm_weight, eps, accumulate,
                                       silu_mul)
    else:
        dense = sparse24_decompress_reference(values, meta, k)
        out.copy_(linear_reference(x, dense, norm_weight, eps, out if accumulate else None, silu_mul))
    return out


def sparse24_gemm_metadata(meta: torch.Tensor) -> torch.Tensor:
    """`meta` [R, W] in the prefill GEMM's order: int32 [R256 / 64, W4 / 2, 128] (R256: R rounded up to 256,
    W4: W rounded up to 4, padding PADDING_WORD). Atom (b, a) holds rows 64 b .. 64 b + 63 and words 2 a, 2 a + 1;
    its word 32 w + 16 t + 2 g + s is what lane (g, t) of warp w passes to wgmma.sp for k-step s: bits 16 t ..
    16 t + 15 of word 2 a + s of row 64 b + 16 w + g in its low half, of row + 8 in its high half."""
    rows, words = meta.shape
    row_blocks = -(-rows // SPARSE24_GEMM_ROW_MULTIPLE) * (SPARSE24_GEMM_ROW_MULTIPLE // 64)
    k_atoms = -(-words // 4) * 2
    full = torch.full((row_blocks * 64, k_atoms * 2), PADDING_WORD, dtype=torch.int64, device=meta.device)
    full[:rows, :words] = meta.to(torch.int64) & 0xFFFFFFFF
    full = full.view(row_blocks, 4, 2, 8, k_atoms, 2)  # block, warp, row half h, g, atom, step
    halves = torch.stack([full & 0xFFFF, full >> 16], dim=-1)  # ..., t: the lane's 16 bits of each word
    words_out = halves[:, :, 0] | (halves[:, :, 1] << 16)  # block, warp, g, atom, step, t
    words_out = words_out.permute(0, 3, 1, 5, 2, 4).reshape(row_blocks, k_atoms, SPARSE24_GEMM_ATOM_WORDS)
    return torch.where(words_out >= 2**31, words_out - 2**32, words_out).to(torch.int32)


def sparse24_meta_from_gemm_metadata(gemm_meta: torch.Tensor, rows: int, words: int) -> torch.Tensor:
    """The [rows, words] `meta` that `sparse24_gemm_metadata` reordered (its inverse)."""
    row_blocks, k_atoms, _ = gemm_meta.shape
    lanes = (gemm_meta.to(torch.int64) & 0xFFFFFFFF).view(row_blocks, k_atoms, 4, 2, 8, 2)  # b, a, warp, t, g, s
    halves = torch.stack([lanes & 0xFFFF, lanes >> 16], dim=-1)  # ..., h
    meta = halves[:, :, :, 0] | (halves[:, :, :, 1] << 16)  # b, a, warp, g, s, h
    meta = meta.permute(0, 2, 5, 3, 1, 4).reshape(row_blocks * 64, k_atoms * 2)[:rows, :words]
    return torch.where(meta >= 2**31, meta - 2**32, meta).to(torch.int32)


def sparse24_gemm_reference(x: torch.Tensor, values: torch.Tensor, gemm_meta: torch.Tensor) -> torch.Tensor:
    """x @ W.T for W the [N, K] matrix of `values` and `gemm_meta` (K = x's columns), fp32 accumulation."""
    k = x.shape[1]
    meta = sparse24_meta_from_gemm_metadata(gemm_meta, values.shape[0], values.shape[1] * 2 // SPARSE24_CHUNK_COLS)
    return linear_reference(x, sparse24_decompress_reference(values, meta, k))


def sparse24_gemm_takes(x: torch.Tensor, rows: int, cols: int) -> bool:
    """Whether `sparse24_gemm` runs the sm_90 kernel for x on an [rows, cols] matrix: minfer's kernels on an
    sm_90 GPU, 16-bit x, cols % 64 == 0 and rows % 8 == 0."""
    return (use_kernels(x) and x.dtype in (torch.float16, torch.bfloat16) and cols % SPARSE24_GEMM_K_MULTIPLE == 0
            and rows % 8 == 0 and is_sm90(x.get_device()))


SPARSE24_GEMM_TILES = ("auto", "128x128", "128x256", "256x128")  # weight rows x tokens (sparse24_ops.cpp)


@fake_impl("minfer::sparse24_gemm")
def _gemm_fake(x, values, gemm_meta, out, tile="auto"):
    return None


def sparse24_gemm(x: torch.Tensor, values: torch.Tensor, gemm_meta: torch.Tensor, out: torch.Tensor | None = None,
                  *, tile: str = "auto") -> torch.Tensor:
    """x @ W.T for prefill with W the [N, K] matrix of `values` [N, K / 2] and `gemm_meta`
    (`sparse24_gemm_metadata(meta)`): x [M, K] -> [M, N], fp32 accumulation. Where `sparse24_gemm_takes` it runs
    the sm_90 kernel (wgmma.mma_async.sp) with `tile` (one of SPARSE24_GEMM_TILES; "auto" picks by shape, the
    others are for tests and benchmarks); elsewhere the reference."""
    if tile not in SPARSE24_GEMM_TILES:
        raise FormatError(f"sparse24_gemm: tile is one of {', '.join(SPARSE24_GEMM_TILES)}, got {tile!r}")
    if x.dim() != 2:
        raise FormatError(f"sparse24_gemm takes x [tokens, K], got {tuple(x.shape)}")
    tokens, k = x.shape
    rows = values.shape[0]
    if values.shape[1] * 2 < k or values.shape[1] * 2 - k >= SPARSE24_CHUNK_COLS:
        raise FormatError(f"sparse24_gemm: x has K={k} but the arrays hold {values.shape[1] * 2} padded columns")
    if out is None:
        out = x.new_empty(tokens, rows)
    elif out.shape != (tokens, rows):
        raise FormatError(f"sparse24_gemm: out must be [{tokens}, {rows}], got {tuple(out.shape)}")
    if sparse24_gemm_takes(x, rows, k) and values.dtype == x.dtype:
        torch.ops.minfer.sparse24_gemm(x.contiguous(), values, gemm_meta, out, tile)
    else:
        out.copy_(sparse24_gemm_reference(x, values, gemm_meta))
    return out
