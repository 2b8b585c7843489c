// Split-K flash-decoding over the static KV cache, with grouped-query attention.
#pragma once
#include "common/launch.h"

namespace minfer {

// Positions one warp takes per pipeline step, and steps per block round (one per warp).
constexpr int kDecodeAttnStepRows = 16;
constexpr int kDecodeAttnWarps = 4;
// Largest number of splits, and of query heads per KV head, the kernel handles.
constexpr int kDecodeAttnMaxSplits = 256;
constexpr int kDecodeAttnMaxGroup = 16;

// The kept key tiles of block-sparse decode, for query tile t of kDecodeAttnKeyTile positions. Either
// listed (tile_ptr set): the layout's decode form (minfer/attention/layouts.py, DecodeLayout): for layout
// group g (0 when groups == 1, else the KV head), key_tiles[tile_ptr[g * q_tiles + t] .. tile_ptr[g * q_tiles
// + t + 1]) in ascending order, and head_bits of the same range: bit j set when query head j of the group
// keeps that tile. Or (tile_ptr null) the sink-window layout computed from t: for layout blocks of
// block_tiles tiles, the first sink_tiles tiles and the tiles of every block holding one of the last
// `window` tokens before some query of t's block, up to t (layouts.py's sink-window, tile by tile).
constexpr int kDecodeAttnKeyTile = 64;
struct DecodeKeptTiles {
    const int32_t* tile_ptr;
    const int32_t* key_tiles;
    const int32_t* head_bits;
    int groups, q_tiles;
    int sink_tiles, window, block_tiles;
};

// Floats the workspace needs: per-(batch, KV head) arrival counters (int32 bits, zero at rest),
// padded to 4 floats, then per-split partial outputs [B, Hq, splits, D] and log-sum-exps [B, Hq, splits].
inline int64_t decode_attention_workspace_floats(int64_t batch, int64_t q_heads, int64_t kv_heads,
                                                 int64_t head_dim, int64_t splits) {
    return (batch * kv_heads + 3) / 4 * 4 + batch * q_heads * splits * (head_dim + 1);
}

// out[b, hq, :] = softmax(q[b, hq, :] . K[b, hq / G, 0..L-1, :] * scale) V[b, hq / G, 0..L-1, :] with
// L = input_pos[0] + 1 (read on the device, clamped to [1, max_seq_len]) and G = q_heads / kv_heads.
// The grid is `splits` blocks per (batch, KV head); each block takes an equal share of the live
// positions, so one captured launch stays valid as L grows. The last block of each KV head to
// finish merges the partial results. k_cache/v_cache: [B, Hkv, max_seq_len, D]; q: [B, Hq, D] with
// strides (q_batch_stride, q_head_stride, 1); out: contiguous [B, Hq, D]. float16/bfloat16, D 64 or 128.
// Reads before griddepcontrol.wait (programmatic dependent launch): input_pos and the cache rows
// before input_pos[0] must be complete before the kernel ahead of this one in the stream starts
// (in decode they come from earlier steps); only q and the newest row may come from that kernel.
// `stages`: 16-position steps each warp keeps in its shared-memory ring (0 = the default; clamped
// to 2 .. what fits the device).
// `kept` (null: dense) makes it block-sparse: the positions are those of the kept key tiles of the query
// tile holding input_pos[0], up to input_pos[0], and the splits share those tiles rather than all
// positions; a query head reads only the tiles its head bit keeps, and one that keeps none gets zeros.
void launch_decode_attention(const void* q, int64_t q_batch_stride, int64_t q_head_stride, const void* k_cache,
                             const void* v_cache, const int64_t* input_pos, float scale, void* out, float* workspace,
                             int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                             int64_t max_seq_len, int splits, int stages, DType dtype, cudaStream_t stream,
                             const DecodeKeptTiles* kept = nullptr);

}  // namespace minfer
