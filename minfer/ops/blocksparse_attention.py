"""Block-sparse causal attention (kernels/blocksparse_attention): the pure-PyTorch reference (CPU path and
test oracle), the fake implementations and the wrapper over torch.ops.minfer.blocksparse_attention.

The layout arrives in its compact form (minfer.attention.layouts.CompactLayout, docs/FORMATS.md): per
layout head (1, or one per query head) and query tile of BLOCKSPARSE_TILE tokens, the ascending list of
key tiles to visit, key_tiles[tile_ptr[h * q_tiles + i] : tile_ptr[h * q_tiles + i + 1]], int32."""

from __future__ import annotations

import torch

from ..errors import MinferError
from .runtime import fake_impl, use_kernels

BLOCKSPARSE_TILE = 64  # kBlocksparseTile (blocksparse_attention.h): query and key tiles are 64 tokens
BLOCKSPARSE_KERNELS = ("auto", "wgmma", "ws", "ws-grid", "ws-nopp", "mma")  # "auto": ws-grid on sm_90, mma elsewhere
REFERENCE_ROWS = 1024  # query rows per step of the reference: bounds its [rows, S] score matrix


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile_ptr: torch.Tensor, layout_heads: int) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise MinferError(f"block-sparse attention takes q [B, Hq, S, D] and k, v [B, Hkv, S, D], got q "
                          f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    batch, q_heads, seq_len, head_dim = q.shape
    if k.shape[0] != batch or k.shape[2] != seq_len or k.shape[3] != head_dim or q_heads % k.shape[1]:
        raise MinferError(f"k and v {tuple(k.shape)} must match q {tuple(q.shape)} in B, S and D, with Hq a "
                          f"multiple of Hkv")
    if layout_heads not in (1, q_heads):
        raise MinferError(f"the layout has {layout_heads} heads; the attention has {q_heads} query heads "
                          "(a layout has 1 or that many)")
    q_tiles = -(-seq_len // BLOCKSPARSE_TILE)
    if tile_ptr.dim() != 1 or tile_ptr.numel() != layout_heads * q_tiles + 1:
        raise MinferError(f"tile_ptr has {tile_ptr.numel()} entries; {layout_heads} layout heads over {seq_len} "
                          f"tokens need {layout_heads * q_tiles + 1}: build the layout for this length")


def blocksparse_tiles(tile_ptr: torch.Tensor, key_tiles: torch.Tensor, layout_heads: int,
                      q_tiles: int) -> torch.Tensor:
    """The boolean (layout_heads, q_tiles, q_tiles) tile layout the compact lists describe, on the CPU."""
    counts = (tile_ptr[1:] - tile_ptr[:-1]).long().cpu()
    rows = torch.repeat_interleave(torch.arange(layout_heads * q_tiles), counts)
    tiles = torch.zeros(layout_heads * q_tiles, q_tiles, dtype=torch.bool)
    tiles[rows, key_tiles.long().cpu()] = True
    return tiles.view(layout_heads, q_tiles, q_tiles)


def blocksparse_token_mask(tile_ptr: torch.Tensor, key_tiles: torch.Tensor, layout_heads: int,
                           seq_len: int) -> torch.Tensor:
    """The boolean (layout_heads, S, S) mask of (query, key) pairs computed: kept tiles, causal inside."""
    tiles = blocksparse_tiles(tile_ptr, key_tiles, layout_heads, -(-seq_len // BLOCKSPARSE_TILE))
    index = torch.arange(seq_len) // BLOCKSPARSE_TILE
    kept = tiles[:, index][:, :, index]
    return kept & torch.ones(seq_len, seq_len, dtype=torch.bool).tril()


def blocksparse_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile_ptr: torch.Tensor,
                                    key_tiles: torch.Tensor, layout_heads: int, scale: float) -> torch.Tensor:
    """Masked softmax attention over the kept tiles, computed in fp32 (float64 for float64 inputs) and
    returned in q's dtype; a query row with no kept key gives zeros."""
    _check_shapes(q, k, v, tile_ptr, layout_heads)
    group = q.shape[1] // k.shape[1]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    keys = k.to(work).repeat_interleave(group, dim=1)
    values = v.to(work).repeat_interleave(group, dim=1)
    mask = blocksparse_token_mask(tile_ptr, key_tiles, layout_heads, q.shape[2]).to(q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for start in range(0, q.shape[2], REFERENCE_ROWS):
        rows = slice(start, start + REFERENCE_ROWS)
        scores = (q[:, :, rows].to(work) @ keys.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~mask[:, rows], float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key: all -inf -> NaN
        out[:, :, rows] = (weights @ values).to(q.dtype)
    return out


@fake_impl("minfer::blocksparse_attention")
def _blocksparse_attention_fake(q, k, v, tile_ptr, key_tiles, layout_heads, scale, out):
    return None


@fake_impl("minfer::blocksparse_attention_tuned")
def _blocksparse_attention_tuned_fake(q, k, v, tile_ptr, key_tiles, layout_heads, scale, out, kernel):
    return None


def blocksparse_kernel_supports(dtype: torch.dtype, head_dim: int) -> bool:
    """The dtypes and head sizes the kernel takes (with rows 16-byte aligned); the rest runs the reference,
    which reads the layout on the host and so cannot run inside CUDA-graph capture."""
    return dtype in (torch.float16, torch.bfloat16) and head_dim in (64, 128)


def _kernel_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> bool:
    def aligned(t):
        return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])

    return blocksparse_kernel_supports(q.dtype, q.shape[-1]) and all(aligned(t) for t in (q, k, v, out))


def blocksparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile_ptr: torch.Tensor,
                          key_tiles: torch.Tensor, layout_heads: int, scale: float, out: torch.Tensor | None = None,
                          kernel: str = "auto") -> torch.Tensor:
    """Causal attention of q [B, Hq, S, D] over k, v [B, Hkv, S, D] (query head h reads KV head
    h // (Hq / Hkv)) that visits only the kept key tiles; any strides with a contiguous last dim. The
    compact layout (tile_ptr, key_tiles, layout_heads) must be built for S tokens, on q's device for the
    kernel. `kernel` (one of BLOCKSPARSE_KERNELS) is a launch knob for tests and benchmarks."""
    if kernel not in BLOCKSPARSE_KERNELS:
        raise MinferError(f"kernel must be one of {BLOCKSPARSE_KERNELS}, got {kernel!r}")
    _check_shapes(q, k, v, tile_ptr, layout_heads)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if use_kernels(q) and _kernel_takes(q, k, v, out):
        if tile_ptr.device != q.device or key_tiles.device != q.device:
            raise MinferError(f"the layout lives on {tile_ptr.device}, the attention on {q.device}; build it on "
                              "q's device once, outside the step")
        if kernel == "auto":
            torch.ops.minfer.blocksparse_attention(q, k, v, tile_ptr, key_tiles, layout_heads, scale, out)
        else:
            torch.ops.minfer.blocksparse_attention_tuned(q, k, v, tile_ptr, key_tiles, layout_heads, scale, out,
                                                         kernel)
    else:
        out.copy_(blocksparse_attention_reference(q, k, v, tile_ptr, key_tiles, layout_heads, scale))
    return out
