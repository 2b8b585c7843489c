"""Block-sparse causal attention: the pure-PyTorch reference (CPU path and test oracle), the fake
implementation and the wrapper over torch.ops.minfer.blocksparse_attention
(kernels/blocksparse_attention/)."""

from __future__ import annotations

import torch

from ..ops.runtime import fake_impl, use_kernels
from .layouts import KERNEL_TILE, CompactLayout, LayoutError

REFERENCE_ROWS = 1024  # query rows per step of the reference: bounds its [rows, S] score matrix


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CompactLayout) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise LayoutError(f"block-sparse attention takes q [B, Hq, S, D] and k, v [B, Hkv, S, D], got q "
                          f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    batch, q_heads, seq_len, head_dim = q.shape
    if k.shape[0] != batch or k.shape[2] != seq_len or k.shape[3] != head_dim or q_heads % k.shape[1]:
        raise LayoutError(f"k and v {tuple(k.shape)} must match q {tuple(q.shape)} in B, S and D, with Hq a "
                          f"multiple of Hkv")
    if layout.seq_len != seq_len:
        raise LayoutError(f"the layout was built for {layout.seq_len} tokens, the attention has {seq_len}; "
                          "build one per length")
    if layout.heads not in (1, q_heads):
        raise LayoutError(f"the layout has {layout.heads} heads; the attention has {q_heads} query heads "
                          "(a layout has 1 or that many)")


def token_mask(layout: CompactLayout) -> torch.Tensor:
    """The boolean (heads, S, S) mask of (query, key) pairs computed: kept tiles, causal inside."""
    tiles = layout.tile_layout()
    index = torch.arange(layout.seq_len) // KERNEL_TILE
    kept = tiles[:, index][:, :, index]
    return kept & torch.ones(layout.seq_len, layout.seq_len, dtype=torch.bool).tril()


def blocksparse_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CompactLayout,
                                    scale: float) -> torch.Tensor:
    """Masked softmax attention over the layout's kept tiles, computed in fp32 (float64 for float64
    inputs) and returned in q's dtype; a query row with no kept key gives zeros."""
    _check_shapes(q, k, v, layout)
    group = q.shape[1] // k.shape[1]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    keys = k.to(work).repeat_interleave(group, dim=1)
    values = v.to(work).repeat_interleave(group, dim=1)
    mask = token_mask(layout).to(q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for start in range(0, q.shape[2], REFERENCE_ROWS):
        rows = slice(start, start + REFERENCE_ROWS)
        scores = (q[:, :, rows].to(work) @ keys.transpose(-1, -2)) * scale
        visible = mask[:, rows]
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key: all -inf -> NaN
        out[:, :, rows] = (weights @ values).to(q.dtype)
    return out


@fake_impl("minfer::blocksparse_attention")
def _blocksparse_attention_fake(q, k, v, tile_ptr, key_tiles, layout_heads, scale, out):
    return None


@fake_impl("minfer::blocksparse_attention_tuned")
def _blocksparse_attention_tuned_fake(q, k, v, tile_ptr, key_tiles, layout_heads, scale, out, kernel):
    return None


# The kernels blocksparse_attention(kernel=...) can name; "auto" is wgmma on sm_90, mma elsewhere.
KERNELS = ("auto", "wgmma", "mma")


def _kernel_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> bool:
    """float16/bfloat16, D 64 or 128, rows 16-byte aligned: everything else runs the reference."""
    def aligned(t):
        return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])

    return (q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in (64, 128)
            and all(aligned(t) for t in (q, k, v, out)))


def blocksparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CompactLayout, scale: float,
                          out: torch.Tensor | None = None, kernel: str = "auto") -> torch.Tensor:
    """Causal attention of q [B, Hq, S, D] over k, v [B, Hkv, S, D] (query head h reads KV head
    h // (Hq / Hkv)) that visits only the layout's kept key tiles; any strides with a contiguous last dim.
    The layout (layouts.compact_layout, on q's device for the kernel) must be built for S tokens.
    `kernel` (one of KERNELS) is a launch knob for tests and benchmarks."""
    if kernel not in KERNELS:
        raise LayoutError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    _check_shapes(q, k, v, layout)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if use_kernels(q) and _kernel_takes(q, k, v, out):
        if layout.tile_ptr.device != q.device:
            raise LayoutError(f"the layout lives on {layout.tile_ptr.device}, the attention on {q.device}; build it "
                              "with compact_layout(..., device=q.device) once, outside the step")
        if kernel == "auto":
            torch.ops.minfer.blocksparse_attention(q, k, v, layout.tile_ptr, layout.key_tiles, layout.heads, scale, out)
        else:
            torch.ops.minfer.blocksparse_attention_tuned(q, k, v, layout.tile_ptr, layout.key_tiles, layout.heads,
                                                         scale, out, kernel)
    else:
        out.copy_(blocksparse_attention_reference(q, k, v, layout, scale))
    return out
