"""Attention over the static KV cache (kernels/attention): split-K flash-decoding with GQA, one query
token per sequence, over every live position (decode_attention) or over the kept key tiles of a
block-sparse layout (blocksparse_decode_attention, whose layout arrays come from
minfer.attention.layouts.DecodeLayout)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import MinferError
from .runtime import fake_impl, use_kernels

# kernels/attention/decode_attention.h
DECODE_ATTENTION_MAX_SPLITS = 256  # kDecodeAttnMaxSplits
DECODE_ATTENTION_MAX_GROUP = 16  # kDecodeAttnMaxGroup: query heads per KV head
DECODE_ATTENTION_SPLIT_ROWS = 64  # kDecodeAttnWarps x kDecodeAttnStepRows: a split covers whole rounds of these
DECODE_ATTENTION_HEAD_DIMS = (64, 128)
DECODE_ATTENTION_DTYPES = (torch.float16, torch.bfloat16)
DECODE_ATTENTION_KEY_TILE = 64  # kDecodeAttnKeyTile: the layout's decode lists count tiles of this many positions
DECODE_ATTENTION_DEFAULT_STAGES = 4  # the kernel's ring depth at D 128 (kWarpRingBytes over one step's K and V)


def _kernel_takes(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in DECODE_ATTENTION_DTYPES and head_dim in DECODE_ATTENTION_HEAD_DIMS


def _group_fits(num_heads: int, num_kv_heads: int) -> bool:
    return num_heads % num_kv_heads == 0 and num_heads <= DECODE_ATTENTION_MAX_GROUP * num_kv_heads


def decode_attention_supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the CUDA kernel runs this attention shape (decode_attention takes the reference for
    other dtypes and head sizes)."""
    return _kernel_takes(dtype, head_dim) and _group_fits(num_heads, num_kv_heads)


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               input_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence, q [B, Hq, D], over cache positions 0..input_pos[0] (clamped into
    the cache) of [B, Hkv, S, D] caches; query head h reads KV head h // (Hq / Hkv). Computed in fp32
    (or wider) without a host sync; positions past the live length are never used, even if NaN."""
    batch, q_heads, _ = q.shape
    kv_heads, max_seq_len = k_cache.shape[1], k_cache.shape[2]
    wide = torch.promote_types(q.dtype, torch.float32)
    last = input_pos.reshape(-1)[0].clamp(0, max_seq_len - 1)
    live = (torch.arange(max_seq_len, device=q.device) <= last)[:, None]  # [S, 1]
    k = torch.where(live, k_cache.to(wide), 0.0).repeat_interleave(q_heads // kv_heads, dim=1)
    v = torch.where(live, v_cache.to(wide), 0.0).repeat_interleave(q_heads // kv_heads, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.to(wide), k) * scale
    scores = scores.masked_fill(~live[:, 0], float("-inf"))
    return torch.einsum("bhs,bhsd->bhd", scores.softmax(dim=-1), v).to(q.dtype)


def blocksparse_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                            input_pos: torch.Tensor, scale: float, tile_ptr: torch.Tensor,
                                            key_tiles: torch.Tensor, head_bits: torch.Tensor,
                                            layout_groups: int) -> torch.Tensor:
    """decode_attention_reference over the positions the layout keeps for the query at input_pos[0]: those
    of the kept key tiles of its query tile (tiles of DECODE_ATTENTION_KEY_TILE), up to input_pos[0],
    where query head j of a KV head's group reads a tile only if bit j of its head_bits entry is set. A
    head that keeps no position gets zeros. Without a host sync: it runs in captured graphs."""
    q_heads = q.shape[1]
    kv_heads, max_seq_len = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    q_tiles = -(-max_seq_len // DECODE_ATTENTION_KEY_TILE)
    wide = torch.promote_types(q.dtype, torch.float32)
    last = input_pos.reshape(-1)[0].clamp(0, max_seq_len - 1)
    # Which entries of key_tiles belong to each layout group's list for this query tile.
    lists = torch.arange(layout_groups, device=q.device) * q_tiles + last // DECODE_ATTENTION_KEY_TILE
    entry = torch.arange(key_tiles.numel(), device=q.device)
    in_list = (entry >= tile_ptr[lists, None]) & (entry < tile_ptr[lists + 1, None])  # [groups, nnz]
    head_keeps = (head_bits[None, :] >> torch.arange(group, device=q.device)[:, None]) & 1  # [G, nnz]
    kept_entries = (in_list[:, None] & head_keeps.bool()[None]).to(wide)  # [groups, G, nnz]
    tiles = torch.zeros(layout_groups, group, q_tiles, dtype=wide, device=q.device)
    tiles.scatter_add_(2, key_tiles.long().expand_as(kept_entries), kept_entries)
    positions = torch.arange(max_seq_len, device=q.device)
    kept = (tiles[..., positions // DECODE_ATTENTION_KEY_TILE] > 0) & (positions <= last)  # [groups, G, S]
    kept = kept.expand(kv_heads, group, max_seq_len).reshape(q_heads, max_seq_len)
    return _masked_decode_attention(q, k_cache, v_cache, kept, scale)


def sink_window_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                           input_pos: torch.Tensor, scale: float, sink: int, window: int,
                                           block_size: int) -> torch.Tensor:
    """decode_attention_reference over the sink-window layout's positions for the query at input_pos[0]
    (minfer.attention.layouts, blocks of block_size tokens): the blocks holding one of the first `sink`
    tokens or one of the last `window` tokens before some query of the query's block, up to input_pos[0]."""
    max_seq_len = k_cache.shape[2]
    last = input_pos.reshape(-1)[0].clamp(0, max_seq_len - 1)
    positions = torch.arange(max_seq_len, device=q.device)
    key_block, query_block = positions // block_size, last // block_size
    kept = (key_block * block_size < sink) | ((key_block + 1) * block_size - 1 >= query_block * block_size - window + 1)
    return _masked_decode_attention(q, k_cache, v_cache, (kept & (positions <= last))[None], scale)


def _masked_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kept: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """Attention of q [B, Hq, D] over the positions `kept` ([Hq or 1, S]) marks, in fp32 or wider; query
    head h reads KV head h // (Hq / Hkv); a head that keeps none gets zeros."""
    group = q.shape[1] // k_cache.shape[1]
    wide = torch.promote_types(q.dtype, torch.float32)
    k = torch.where(kept[None, :, :, None], k_cache.to(wide).repeat_interleave(group, dim=1), 0.0)
    v = torch.where(kept[None, :, :, None], v_cache.to(wide).repeat_interleave(group, dim=1), 0.0)
    scores = torch.einsum("bhd,bhsd->bhs", q.to(wide), k) * scale
    weights = scores.masked_fill(~kept[None], float("-inf")).softmax(dim=-1).nan_to_num(0.0)
    return torch.einsum("bhs,bhsd->bhd", weights, v).to(q.dtype)


def decode_attention_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device | str) -> int:
    """Splits per (batch, KV head) that give each SM one block; on the H100, 2x and 3x as many were
    slower at every context tried (more merge work, no more bandwidth)."""
    sms = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    most_useful = -(-max_seq_len // DECODE_ATTENTION_SPLIT_ROWS)
    return max(1, min(sms // (batch * num_kv_heads), most_useful, DECODE_ATTENTION_MAX_SPLITS))


def decode_attention_ring_stages(kept_positions: int, num_splits: int) -> int:
    """The K/V ring depth (16-position steps per warp) for block-sparse decode over at most `kept_positions`:
    one more than the steps a warp takes, so all of them are issued before the kernel waits for the previous
    one, and no deeper, so a smaller block leaves room on its SM for more splits and for the next launch's
    blocks. 0 (the kernel's default depth) when a warp takes as many steps as that holds or more."""
    warp_steps = -(-(-(-kept_positions // num_splits)) // DECODE_ATTENTION_SPLIT_ROWS)
    return warp_steps + 1 if warp_steps + 1 < DECODE_ATTENTION_DEFAULT_STAGES else 0


def _decode_attention_counter_floats(batch: int, num_kv_heads: int) -> int:
    return -(-batch * num_kv_heads // 4) * 4


def decode_attention_workspace(batch: int, num_heads: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                               device: torch.device | str, num_splits: int | None = None) -> torch.Tensor:
    """The zeroed fp32 buffer decode_attention keeps its per-split partials in; allocate it once per
    model (all layers can share it) and pass it to every call, so decode allocates nothing."""
    if num_splits is None:
        num_splits = decode_attention_splits(batch, num_kv_heads, max_seq_len, device)
    if not 1 <= num_splits <= DECODE_ATTENTION_MAX_SPLITS:
        raise MinferError(f"num_splits must be in 1..{DECODE_ATTENTION_MAX_SPLITS}, got {num_splits}")
    floats = _decode_attention_counter_floats(batch, num_kv_heads) + batch * num_heads * num_splits * (head_dim + 1)
    return torch.zeros(floats, dtype=torch.float32, device=device)


def _decode_attention_workspace_splits(workspace: torch.Tensor, batch: int, num_heads: int, num_kv_heads: int,
                                       head_dim: int) -> int:
    per_split = batch * num_heads * (head_dim + 1)
    splits, rest = divmod(workspace.numel() - _decode_attention_counter_floats(batch, num_kv_heads), per_split)
    if rest or not 1 <= splits <= DECODE_ATTENTION_MAX_SPLITS:
        raise MinferError(f"the decode_attention workspace ({workspace.numel()} floats) does not fit B={batch}, "
                          f"Hq={num_heads}, Hkv={num_kv_heads}, D={head_dim}; make it with decode_attention_workspace()")
    return splits



@fake_impl("minfer::decode_attention")
def _decode_attention_fake(q, k_cache, v_cache, input_pos, scale, out, workspace, num_splits):
    return None


@fake_impl("minfer::decode_attention_tuned")
def _decode_attention_tuned_fake(q, k_cache, v_cache, input_pos, scale, out, workspace, num_splits, stages):
    return None


@fake_impl("minfer::decode_attention_sink_window")
def _decode_attention_sink_window_fake(q, k_cache, v_cache, input_pos, scale, out, workspace, num_splits, sink,
                                       window, block_size, stages):
    return None


@fake_impl("minfer::decode_attention_blocksparse")
def _decode_attention_blocksparse_fake(q, k_cache, v_cache, input_pos, scale, out, workspace, num_splits, tile_ptr,
                                       key_tiles, head_bits, layout_groups, stages):
    return None


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, input_pos: torch.Tensor,
                     scale: float, out: torch.Tensor | None = None,
                     workspace: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [B, Hq, D] (one token per sequence) over cache positions 0..input_pos[0].

    input_pos is an int64 device tensor of one element, so a captured graph stays valid as the
    context grows. float16/bfloat16 with D 64 or 128 run the CUDA kernel, which reads each KV head
    once for all its query heads; float32 and other head dims run the reference (parity tests, tiny
    models). `workspace` comes from decode_attention_workspace(); without one, each call allocates.
    """
    if out is None:
        out = q.new_empty(q.shape)
    if use_kernels(q) and _kernel_takes(q.dtype, q.shape[-1]):
        batch, num_heads, head_dim = q.shape
        num_kv_heads, max_seq_len = k_cache.shape[1], k_cache.shape[2]
        if not _group_fits(num_heads, num_kv_heads):
            raise MinferError(f"the decode_attention kernel takes 1..{DECODE_ATTENTION_MAX_GROUP} query heads per KV "
                              f"head, got Hq={num_heads}, Hkv={num_kv_heads}; ops.backend('torch') runs the reference")
        if workspace is None:
            workspace = decode_attention_workspace(batch, num_heads, num_kv_heads, head_dim, max_seq_len, q.device)
        splits = _decode_attention_workspace_splits(workspace, batch, num_heads, num_kv_heads, head_dim)
        torch.ops.minfer.decode_attention(q, k_cache, v_cache, input_pos, scale, out, workspace, splits)
    else:
        out.copy_(decode_attention_reference(q, k_cache, v_cache, input_pos, scale))
    return out



def blocksparse_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 input_pos: torch.Tensor, scale: float, tile_ptr: torch.Tensor, key_tiles: torch.Tensor,
                                 head_bits: torch.Tensor, layout_groups: int, out: torch.Tensor | None = None,
                                 workspace: torch.Tensor | None = None, stages: int | None = None,
                                 kept_positions: int | None = None) -> torch.Tensor:
    """decode_attention over the kept key tiles only (blocksparse_decode_attention_reference says which).

    The layout arrays (minfer.attention.layouts.DecodeLayout, built for the cache's max_seq_len) live on
    q's device; the kernel finds the query tile's list from input_pos on the device, and its splits share
    the kept tiles, so one captured launch serves every position. A workspace sized for the most kept
    positions of any query tile (decode_attention_workspace with that length) keeps every split busy.
    `stages`: the kernel's K/V ring depth (0 = its default); None fits it to `kept_positions`, the most
    positions any query tile keeps (None: the whole cache), with decode_attention_ring_stages.
    """
    q_tiles = -(-k_cache.shape[2] // DECODE_ATTENTION_KEY_TILE)
    if layout_groups not in (1, k_cache.shape[1]) or tile_ptr.numel() != layout_groups * q_tiles + 1:
        raise MinferError(f"the decode layout ({layout_groups} groups, {tile_ptr.numel()} list bounds) does not fit a "
                          f"cache of {k_cache.shape[1]} KV heads and {k_cache.shape[2]} positions; build it for them")
    return _sparse_decode(
        q, k_cache, out, workspace, stages, kept_positions,
        lambda out, workspace, splits, stages: torch.ops.minfer.decode_attention_blocksparse(
            q, k_cache, v_cache, input_pos, scale, out, workspace, splits, tile_ptr, key_tiles, head_bits,
            layout_groups, stages),
        lambda: blocksparse_decode_attention_reference(q, k_cache, v_cache, input_pos, scale, tile_ptr, key_tiles,
                                                       head_bits, layout_groups))


def sink_window_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 input_pos: torch.Tensor, scale: float, sink: int, window: int, block_size: int,
                                 out: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
                                 stages: int | None = None, kept_positions: int | None = None) -> torch.Tensor:
    """blocksparse_decode_attention for the sink-window layout (`sink`, `window` tokens; layout blocks of
    `block_size`, a multiple of DECODE_ATTENTION_KEY_TILE), whose kept tiles the kernel computes from
    input_pos instead of reading lists: the same positions, with no list loads ahead of the K/V loads."""
    if sink < 0 or window < 1 or block_size < 1 or block_size % DECODE_ATTENTION_KEY_TILE:
        raise MinferError(f"sink-window decode takes sink >= 0, window >= 1 and blocks of a multiple of "
                          f"{DECODE_ATTENTION_KEY_TILE}, got sink={sink}, window={window}, block_size={block_size}")
    return _sparse_decode(
        q, k_cache, out, workspace, stages, kept_positions,
        lambda out, workspace, splits, stages: torch.ops.minfer.decode_attention_sink_window(
            q, k_cache, v_cache, input_pos, scale, out, workspace, splits, sink, window, block_size, stages),
        lambda: sink_window_decode_attention_reference(q, k_cache, v_cache, input_pos, scale, sink, window,
                                                       block_size))


def _sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor | None, workspace: torch.Tensor | None,
                   stages: int | None, kept_positions: int | None,
                   kernel: Callable[[torch.Tensor, torch.Tensor, int, int], None],
                   reference: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`kernel(out, workspace, splits, stages)` when the CUDA kernel takes q (without a workspace, one for the
    whole cache is allocated), else out = `reference()`."""
    if out is None:
        out = q.new_empty(q.shape)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if use_kernels(q) and decode_attention_supports(q.dtype, num_heads, num_kv_heads, head_dim):
        if workspace is None:
            workspace = decode_attention_workspace(batch, num_heads, num_kv_heads, head_dim, k_cache.shape[2],
                                                   q.device)
        splits = _decode_attention_workspace_splits(workspace, batch, num_heads, num_kv_heads, head_dim)
        if stages is None:
            stages = decode_attention_ring_stages(kept_positions or k_cache.shape[2], splits)
        kernel(out, workspace, splits, stages)
    else:
        out.copy_(reference())
    return out
