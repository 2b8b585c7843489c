// Decode GEMV: out[t, n] = sum_k w[n, k] * x[t, k] for 1..8 tokens; w is row-major [N, K] (HF layout).
#pragma once
#include "common/launch.h"

namespace minfer {

// The tensor-core path feeds the tokens as the n=8 side of mma.m16n8k16, so 8 is the ceiling.
constexpr int kGemvMaxTokens = 8;

// Launch configuration of the tensor-core path; 0 picks the measured default for the shape.
struct GemvTuning {
    int warps_per_block = 0;  // 4, 8 or 16 warps sharing one 16-row tile's K range
    int unroll = 0;           // 16x32 warp steps per load batch: 2, 4 or 8 (at most 4 with 16 warps)
};

// x [tokens, k], w [n, k], out [tokens, n]; float16 or bfloat16, fp32 accumulation; `fusion` as in
// launch.h (g * x is rounded to the dtype: it feeds the tensor cores).
// K a multiple of 8 with 16-byte aligned x, w and g takes the fast path; anything else a scalar one.
void launch_gemv(const void* x, const void* w, void* out, int64_t tokens, int64_t n, int64_t k, DType dtype,
                 const ProjectionFusion& fusion, const GemvTuning& tuning, cudaStream_t stream);

}  // namespace minfer
