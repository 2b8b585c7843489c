// Decode GEMV: out[t, n] = sum_k w[n, k] * x[t, k] for 1..8 tokens; w is row-major [N, K] (HF layout).
#pragma once
#include "launch.h"

namespace minfer {

// The tensor-core path feeds the tokens as the n=8 side of mma.m16n8k16, so 8 is the ceiling.
constexpr int kGemvMaxTokens = 8;

// Launch configuration; all 0 picks the default: the bulk-copy kernel on sm_90+ with 4 stages per
// block, the register-streaming kernel before sm_90 (or where the bulk kernel's plan does not fit)
// with the measured default for the shape. Setting warps_per_block or unroll selects the
// register-streaming kernel, stages_per_block the bulk-copy one.
struct GemvTuning {
    int warps_per_block = 0;   // register kernel: 4, 8 or 16 warps sharing one 16-row tile's K range
    int unroll = 0;            // register kernel: 16x32 warp steps per load batch: 2, 4 or 8 (at most 4 with 16 warps)
    int stages_per_block = 0;  // bulk kernel (sm_90+): 512-column stages of a 16-row tile per block, 1..16
};

// x [tokens, k], w [n, k], out [tokens, n]; float16 or bfloat16, fp32 accumulation; `fusion` as in
// launch.h (g * x is rounded to the dtype: it feeds the tensor cores).
// K a multiple of 8 with 16-byte aligned x, w and g takes a tensor-core path; anything else a scalar one.
void launch_gemv(const void* x, const void* w, void* out, int64_t tokens, int64_t n, int64_t k, DType dtype,
                 const ProjectionFusion& fusion, const GemvTuning& tuning, cudaStream_t stream);

// How the bulk-copy kernel (gemv_bulk.cu) covers a row of K columns: `total_stages` stages of 512
// columns, split over `splits` blocks of one cluster (at most 8), at most `stages_per_block` each.
struct GemvBulkPlan {
    int total_stages = 0;
    int splits = 0;
    int stages_per_block = 0;
    bool fits = false;  // false: the stages do not fit in shared memory, use the register kernel
};

GemvBulkPlan plan_gemv_bulk(int64_t k, int stages_per_block);

// Launches the bulk-copy kernel (sm_90+, K % 8 == 0, 16-byte aligned pointers); false if it cannot
// get the shared memory it needs.
bool launch_gemv_bulk(const void* x, const void* w, void* out, int tokens, int n, int k, DType dtype,
                      const ProjectionFusion& fusion, const GemvBulkPlan& plan, cudaStream_t stream);

}  // namespace minfer
