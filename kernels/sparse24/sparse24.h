// 2:4 semi-structured sparse matrices (docs/FORMATS.md, "2:4"): the decode GEMV and decompression.
// A rows x cols matrix is stored as `values` [rows][C32 / 2] (the 2 kept entries of every group of 4
// columns, in column order) and `meta` [rows][C32 / 32] int32 (bits 4j..4j+3 of word c: group 8c + j's two
// slots, slot0 | slot1 << 2, slot0 < slot1), C32 = cols rounded up to a multiple of 32, padding zero.
// Framework-free launchers.
#pragma once
#include "common/launch.h"

namespace minfer {

constexpr int kSparse24ChunkCols = 32;  // columns of one metadata word (16 kept values: 32 bytes in fp16)
constexpr int kSparse24MaxTokens = 16;  // two n = 8 mma tiles

// out[t, r] = sum_c W[r, c] * x[t, c] for 1..16 tokens; x [tokens, cols] and out [tokens, rows] (with
// silu_mul [tokens, rows / 2]) contiguous in the values' dtype (fp16 or bf16); `fusion` as in launch.h
// (silu_mul not with accumulate). cols % 8 == 0 with 16-byte aligned x, values and norm weight takes the
// tensor-core path; anything else a scalar one.
void launch_sparse24_gemv(const void* values, const int32_t* meta, const void* x, void* out, int64_t tokens,
                          int64_t rows, int64_t cols, DType dtype, const ProjectionFusion& fusion,
                          cudaStream_t stream);

// out [rows][cols] (contiguous) = the dense matrix of the arrays.
void launch_sparse24_decompress(const void* values, const int32_t* meta, void* out, int64_t rows, int64_t cols,
                                DType dtype, cudaStream_t stream);

}  // namespace minfer
