// 2:4 semi-structured sparse matrices (docs/FORMATS.md, "2:4"): the decode GEMV, decompression and the
// prefill GEMM on Hopper's sparse tensor cores. The GEMV's tensor-core path and the GEMM each read the
// metadata in their own order, a copy made from `meta` (gemv_meta, gemm_meta below).
// A rows x cols matrix is stored as `values` [rows][C32 / 2] (the 2 kept entries of every group of 4
// columns, in column order) and `meta` [rows][C32 / 32] int32 (bits 4j..4j+3 of word c: group 8c + j's two
// slots, slot0 | slot1 << 2, slot0 < slot1), C32 = cols rounded up to a multiple of 32, padding zero.
// Framework-free launchers.
#pragma once
#include "common/launch.h"

namespace minfer {

constexpr int kSparse24ChunkCols = 32;  // columns of one metadata word (16 kept values: 32 bytes in fp16)
constexpr int kSparse24MaxTokens = 16;  // two n = 8 mma tiles

// The decode GEMV's metadata order (`gemv_meta`, docs/FORMATS.md): int32 [R8][S][8][4], R8 = ceil(rows / 8)
// groups of 8 rows, S = ceil(chunks / 4) warp steps of 4 meta words (128 columns), chunks = ceil(cols / 32).
// Word [row / 8][step][row % 8][t], at ((row / 8 * S + step) * 8 + row % 8) * 4 + t, is what lane
// 4 (row % 8) + t multiplies for the row at `step`: its low 16 bits are half t & 1 (bits 16 (t & 1) ..
// 16 (t & 1) + 15) of meta word 4 step + t / 2 of the row, its high 16 bits the same half of word
// 4 step + t / 2 + 2 (the groups of the lane's value pieces t and t + 4). Words past the row's chunks, and rows
// past the last, read as 0x44444444 (every group at positions 0, 1). The 8 rows x 4 lanes of a step are 128
// contiguous bytes: one coalesced load per row and step for a warp.
constexpr int kSparse24GemvRowGroup = 8;    // rows of a group: one per lane quad g = lane / 4
constexpr int kSparse24GemvStepChunks = 4;  // meta words of one row per warp step (lanes t = lane % 4)

// gemv_meta (above) of meta [rows][chunks], both contiguous on the device.
void launch_sparse24_gemv_metadata(const int32_t* meta, int64_t rows, int64_t chunks, int32_t* gemv_meta,
                                   cudaStream_t stream);

// out[t, r] = sum_c W[r, c] * x[t, c] for 1..16 tokens; x [tokens, cols] and out [tokens, rows] (with
// silu_mul [tokens, rows / 2]) contiguous in the values' dtype (fp16 or bf16); `fusion` as in launch.h
// (silu_mul not with accumulate). cols % 8 == 0 with 16-byte aligned x, values and norm weight takes the
// tensor-core path, which reads the metadata as `gemv_meta`; anything else a scalar one, which reads `meta`.
void launch_sparse24_gemv(const void* values, const int32_t* meta, const int32_t* gemv_meta, const void* x,
                          void* out, int64_t tokens, int64_t rows, int64_t cols, DType dtype,
                          const ProjectionFusion& fusion, cudaStream_t stream);

// The prefill GEMM's metadata order (`gemm_meta`, docs/FORMATS.md): int32 [R256 / 64][K128 / 64][128], R256
// the rows rounded up to 256, K128 the columns rounded up to 128; atom (row block b, column block a) word
// 32 w + 16 t + 2 g + s holds, for rows r = 64 b + 16 w + g and r + 8 (low and high 16 bits), bits 16 t .. 16 t + 15
// of meta word 2 a + s. Padding holds 0x4444 halves (slots 0, 1).
constexpr int kSparse24GemmAtomWords = 128;
constexpr int kSparse24GemmRowMultiple = 256;
constexpr int kSparse24GemmKMultiple = 64;  // what the GEMM takes: K % 64 == 0, N % 8 == 0

// The GEMM's tiles, weight rows x tokens; kAuto picks by shape (the launcher's choose_tile).
enum class Sparse24GemmTile : int { kAuto = 0, k128x128 = 1, k128x256 = 2, k256x128 = 3 };

// y [m, n] = x [m, k] @ W^T for W the [n, k] matrix of `values` [n, k / 2] and `gemm_meta`, fp32 accumulation,
// on sm_90a (wgmma.mma_async.sp). Tensors contiguous, 16-byte aligned. Returns nullptr on success, else what
// is wrong.
const char* launch_sparse24_gemm(const void* values, const int32_t* gemm_meta, const void* x, void* y, int64_t m,
                                 int64_t n, int64_t k, DType dtype, Sparse24GemmTile tile, cudaStream_t stream);

// True when the current device is an sm_90 part and this build holds the sm_90a GEMM for it.
bool sparse24_gemm_sm90_available();

// out [rows][cols] (contiguous) = the dense matrix of the arrays.
void launch_sparse24_decompress(const void* values, const int32_t* meta, void* out, int64_t rows, int64_t cols,
                                DType dtype, cudaStream_t stream);

}  // namespace minfer
