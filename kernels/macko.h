// MACKO-16-4 sparse matrices (see shared/FORMATS.md): SpMV/SpMM and decompression to dense.
// A matrix of `rows` x `cols` is stored as `values` (P fp16/bf16, P % 8 == 0), `deltas` (P/2 bytes,
// 4-bit column gaps, low nibble first) and `row_ptr` (rows + 1 int32). Framework-free launchers.
#pragma once
#include "launch.h"

namespace minfer {

// Launch knobs for benchmarking; 0 (or -1 for x_in_smem) picks the tuned default.
struct MackoTuning {
    int steps = 0;            // 256-entry warp steps loaded per pipeline stage: 1 or 2
    int warps_per_block = 0;  // 4, 8 or 16 warps, one row per warp at a time (0, one token: as many as
                              // give every warp the same number of rows, at most 16)
    int x_in_smem = -1;       // 1 (and the default): stage x in shared memory when it fits; 0: gather x from global
    int pipeline = 1;         // 0: the reference kernel's schedule (load, then decode; x from global)
};

// The RMSNorm of a Llama sublayer, fused into a one-token SpMV: x is replaced by
// g * x * rsqrt(mean(x^2) + eps), with g * x rounded to the dtype and the fp32 scale applied to each
// row's sum (as the fused GEMV computes it). Each block stages all of x as fp32 in shared memory.
struct MackoNorm {
    const void* weight = nullptr;  // g [cols] in the values' dtype; null: no norm
    float eps = 0.f;
};
// Longest x the one-token kernel stages (64 KB of fp32 per block, and 8 KB of the norm's sums of x^2):
// the norm and silu_mul fuse up to it.
constexpr int kMackoFusedMaxCols = 16384;

// out[t, r] = sum_c W[r, c] * x[t, c] for t < tokens (with `accumulate`, out[t, r] += that: the
// residual add of a Llama sublayer, in place). x is [tokens, cols], out is [tokens, rows], both
// contiguous, in the values' dtype. values must be 16-byte aligned, deltas 4-byte aligned.
// `silu_mul`: W is the MLP's [gate; up] (rows even) and out [tokens, rows / 2] receives
// silu(gate) * up (not with accumulate). A norm or silu_mul needs tokens == 1,
// cols <= kMackoFusedMaxCols, the pipelined kernel and x in shared memory.
void launch_macko_spmv(const void* values, const uint8_t* deltas, const int32_t* row_ptr, const void* x,
                       void* out, int64_t rows, int64_t cols, int64_t tokens, bool accumulate,
                       const MackoNorm& norm, bool silu_mul, DType dtype, const MackoTuning& tuning,
                       cudaStream_t stream);

// out = W as a dense, contiguous [rows, cols] matrix (every element written).
void launch_macko_decompress(const void* values, const uint8_t* deltas, const int32_t* row_ptr, void* out,
                             int64_t rows, int64_t cols, DType dtype, cudaStream_t stream);

}  // namespace minfer
