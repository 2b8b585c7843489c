// HF half-split rotary embedding (rotate_half) fused with the KV-cache write.
#pragma once
#include "common/launch.h"

namespace minfer {

// Strides (in elements) of a [B, T, H, D] activation whose last dimension is contiguous.
struct TokenHeadStrides {
    int64_t batch, token, head;
};

// For each batch b and token t at position p = input_pos[t]:
//   q[b, t, h, :] = rope(q[b, t, h, :], p)                (in place)
//   k_cache[b, h, p, :] = rope(k[b, t, h, :], p), v_cache[b, h, p, :] = v[b, t, h, :]
// with rope(x)[i] = x[i] cos - x[i + D/2] sin and rope(x)[i + D/2] = x[i + D/2] cos + x[i] sin for
// i < D/2; cos and sin are fp32 tables [max_seq_len, D/2]. Tokens whose position lies outside
// [0, max_seq_len) are left untouched (the caller checks the context length). input_pos, cos and
// sin are read before griddepcontrol.wait: they must be complete before the kernel ahead of this one
// in the stream starts (in decode, input_pos is advanced at the end of the previous step).
void launch_rope_write_kv(void* q, const void* k, const void* v, const float* cos, const float* sin,
                          const int64_t* input_pos, void* k_cache, void* v_cache, int64_t batch, int64_t tokens,
                          int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t max_seq_len,
                          TokenHeadStrides q_strides, TokenHeadStrides k_strides, TokenHeadStrides v_strides,
                          DType dtype, cudaStream_t stream);

}  // namespace minfer
