// Decode GEMV: out[t, n] = sum_k w[n, k] * x[t, k] for 1..8 tokens; w is row-major [N, K] (HF layout).
#pragma once
#include "launch.h"

namespace minfer {

// The tensor-core path feeds the tokens as the n=8 side of mma.m16n8k16, so 8 is the ceiling.
constexpr int kGemvMaxTokens = 8;

// Launch configuration of the tensor-core path; 0 picks the measured default for the shape.
struct GemvTuning {
    int warps_per_block = 0;  // 4, 8 or 16 warps sharing one 16-row tile's K range
    int unroll = 0;           // 16x32 warp steps per load batch: 2, 4 or 8 (at most 4 with 16 warps)
};

// The attention's qkv projection epilogue (batch 1): W's rows are q heads, k heads, v heads of
// head_dim D (a multiple of 16). In `out`, q and k get HF half-split RoPE (rotate_half) at
// positions[t] (cos, sin: fp32 [>= max_seq_len, D / 2]); the rotated k and v are also stored into
// k_cache / v_cache [kv_heads, max_seq_len, D] at that position. A position outside
// [0, max_seq_len) leaves its token unrotated and uncached. positions, cos and sin are read before the
// PDL wait: they must be complete before the kernel ahead of this one starts (as in rope.h).
struct RopeKvWrite {
    const float* cos = nullptr;
    const float* sin = nullptr;
    const int64_t* positions = nullptr;
    void* k_cache = nullptr;
    void* v_cache = nullptr;
    int q_heads = 0, kv_heads = 0, head_dim = 0, max_seq_len = 0;
};

// x [tokens, k], w [n, k], out [tokens, n]; float16 or bfloat16, fp32 accumulation; `fusion` as in
// launch.h (g * x is rounded to the dtype: it feeds the tensor cores); `rope` (or null) as above, on
// the tensor-core path with the norm fused only (the caller runs rope_write_kv otherwise).
// K a multiple of 8 with 16-byte aligned x, w and g takes the fast path; anything else a scalar one.
void launch_gemv(const void* x, const void* w, void* out, int64_t tokens, int64_t n, int64_t k, DType dtype,
                 const ProjectionFusion& fusion, const RopeKvWrite* rope, const GemvTuning& tuning,
                 cudaStream_t stream);

// Whether launch_gemv can fuse `rope` for these arguments (else: launch_gemv, then rope_write_kv).
bool gemv_fuses_rope(const void* x, const void* w, int64_t k, const ProjectionFusion& fusion, int head_dim);

}  // namespace minfer
