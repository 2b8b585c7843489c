// Block-sparse causal attention (prefill): the launcher the bindings call. Framework-free.
#pragma once
#include "common/launch.h"

namespace minfer {

// Query and key tile of the kernel, in tokens: the compact layout's lists are at this granularity.
constexpr int kBlocksparseTile = 64;

// Which kernel runs. The warp-specialized wgmma kernel (ws: TMA producer, consumers in ping-pong, persistent
// grid) and two of its levers turned off (ws-grid: one query-tile pair per block; ws-nopp: no ping-pong) run
// on sm_90a beside the plain wgmma kernel; mma.sync runs anywhere. auto picks ws-grid on sm_90 (wgmma where
// the tensors' strides defeat its TMA maps), mma.sync elsewhere.
enum class BlocksparseKernel : int { kAuto = 0, kWgmma = 1, kMma = 2, kWs = 3, kWsGrid = 4, kWsNoPingPong = 5 };

// A [B, H, S, D] tensor's element strides for batch, head and position (the last dim is contiguous).
struct AttnStrides {
    int64_t batch, head, seq;
};

// out[b, h, i, :] = softmax_j(q[b, h, i] . k[b, h / G, j] * scale) v[b, h / G, j] over the keys j <= i
// whose 64-token tile is listed for query tile i / 64: the list of (head l, query tile t) is
// key_tiles[tile_ptr[l * q_tiles + t] .. tile_ptr[l * q_tiles + t + 1]), ascending, no tile above t;
// l = h when layout_heads == q_heads, else 0. A query whose tile lists nothing gets zeros.
// G = q_heads / kv_heads. q, k, v, out share float16/bfloat16, head_dim 64 or 128, S positions each,
// 16-byte aligned rows. Returns nullptr, or why the launch could not be made.
const char* launch_blocksparse_attention(const void* q, AttnStrides q_strides, const void* k, AttnStrides k_strides,
                                  const void* v, AttnStrides v_strides, void* out, AttnStrides out_strides,
                                  const int* tile_ptr, const int* key_tiles, int64_t batch, int64_t q_heads,
                                  int64_t kv_heads, int64_t layout_heads, int64_t seq_len, int64_t head_dim,
                                  float scale, DType dtype, BlocksparseKernel kernel, cudaStream_t stream);

}  // namespace minfer
