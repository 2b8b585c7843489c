// MACKO-16-4 sparse matrices (see docs/FORMATS.md): SpMV/SpMM and decompression to dense.
// A matrix of `rows` x `cols` is stored as `values` (P fp16/bf16, P % 8 == 0), `deltas` (P/2 bytes,
// 4-bit column gaps, low nibble first) and `row_ptr` (rows + 1 int32). Framework-free launchers.
#pragma once
#include "common/launch.h"

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

// The tensor-core SpMM splits each row into runs of column windows of this many columns. A window table
// [rows][windows - 1] (windows = ceil(cols / kMackoWindowCols)) holds, for windows 1.., where each row's
// run starts: P = the row's first entry in or past the window, rounded up to a whole 8-entry chunk of the
// values (at most the row's end); the entry is (P - the row's first entry) << 7 | (origin + 15), origin =
// P's column - its nibble - the window's first column, in -15..112 (0 when P is the row's end). A run's
// last chunk may so reach up to 112 columns into the next window.
constexpr int kMackoWindowCols = 1024;
constexpr int64_t kMackoTensorCoreMaxCols = 1 << 23;  // a row's entries fit the table's 24-bit field
constexpr int kMackoTileRows = 32;          // rows of one tensor-core SpMM block
constexpr int kMackoTensorCoreTokens = 16;  // tokens of one tensor-core SpMM pass (the mma's M)

// out[t, r] (+)= sum_c W[r, c] * x[t, c] for tokens <= 16 on the tensor cores: each block walks the runs
// of kMackoTileRows rows in window after window of its share of the columns (k_splits shares), scatters
// them into a dense tile in shared memory and multiplies it with that window of x (mma.sync). With
// k_splits > 1, each share's fp32 sums go to `partials` [k_splits][16][tiles * kMackoTileRows] and the
// last block of a tile to arrive (counters[tile], zero at rest and left zero) adds them in share order,
// so the result does not depend on the split's timing. x [tokens, cols] and out [tokens, rows] contiguous.
// steps: 256-entry warp steps loaded per group (1 or 2; 0: the tuned default).
void launch_macko_tensor_core_spmm(const void* values, const uint8_t* deltas, const int32_t* row_ptr,
                                   const int32_t* window_table, const void* x, void* out, float* partials,
                                   int32_t* counters, int64_t rows, int64_t cols, int64_t tokens, int k_splits,
                                   int steps, bool accumulate, DType dtype, cudaStream_t stream);

// out = W as a dense, contiguous [rows, cols] matrix (every element written).
void launch_macko_decompress(const void* values, const uint8_t* deltas, const int32_t* row_ptr, void* out,
                             int64_t rows, int64_t cols, DType dtype, cudaStream_t stream);

}  // namespace minfer
