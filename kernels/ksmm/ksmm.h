// Kronecker-sparse (KS) factors (docs/FORMATS.md, "Kronecker-sparse factors"): one fused kernel per factor.
// A factor of pattern (a, b, c, d) is W [a][b][c][d]; for a batch-first x [tokens][a*c*d] it writes
//     y[n][(i*b + j)*d + l] = sum_k x[n][(i*c + k)*d + l] * W[i][j][k][l]
// reading x with the stride-d gather and writing y with the stride-d scatter in place (no permutation pass),
// fp16/bf16 in and out, fp32 accumulation. Framework-free launchers.
#pragma once
#include "common/launch.h"

namespace minfer {

// Up to this many tokens the bandwidth paths run (gemv, rows): each weight is read once for all tokens.
// W[i][j][:][:] and x[n][i][:][:] are contiguous c*d runs, so a factor is a segmented GEMV.
constexpr int kKsmmRowsMaxTokens = 16;
// The rows kernel keeps d sums per token of a row; it takes d a power of two up to this.
constexpr int kKsmmRowsMaxD = 64;
// The wgmma kernel's b and c are multiples of this (TMA rows of c in 16-byte units; two outputs a store).
constexpr int kKsmmWgmmaMultiple = 8;

// Which kernel runs a factor. kAuto: rows for one token, gemv up to kKsmmRowsMaxTokens tokens, tensor cores past
// them, generic for what none takes (the first that takes the shape; rows beat gemv at one token on 57 of 61
// grid patterns and gemv beat rows at 16 on all 61, docs/perf-notes.md). The others force one, for tests and
// benchmarks; a kernel refuses what it cannot run.
// - kGemv: the row runs in 16-byte chunks on mma.sync (16 rows x up to 16 tokens), d in {1, 2, 4} or a
//   multiple of 8, c*d a multiple of 8, x and W 16-byte aligned;
// - kRows: the row runs on CUDA cores with fp32 sums per l, d a power of two up to kKsmmRowsMaxD, same
//   alignment;
// - kTensorCore: GEMM tiles per (i, group of l's) on mma.sync, any batch, gemv's shapes, y 16-byte aligned too;
// - kGeneric: one thread per output, anything;
// - kWgmma: d = 1 on the sm_90a wgmma kernel (launch_ksmm_wgmma); not in kAuto (minfer/ops/ksmm.py routes prefill
//   to it, KSMM_WGMMA_MIN_TOKENS).
enum class KsmmPath : int { kAuto = 0, kGeneric = 1, kRows = 2, kTensorCore = 3, kGemv = 4, kWgmma = 5 };

// Whether `path` can run this shape (pointers 16-byte aligned where the fast paths need it).
bool ksmm_path_supports(KsmmPath path, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d, const void* x,
                        const void* w, const void* y);

// The kernel kAuto runs for this shape on the current device.
KsmmPath ksmm_auto_path(int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d, const void* x, const void* w,
                        const void* y);

// y [tokens][a*b*d] = x [tokens][a*c*d] times the factor's matrix transposed; all contiguous, one dtype
// (float16 or bfloat16). y must not overlap x. `path` must support the shape (ksmm_path_supports).
void launch_ksmm(const void* x, const void* w, void* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                 KsmmPath path, DType dtype, cudaStream_t stream);

// The gemv kernel with a decode projection's fusions (launch.h, ProjectionFusion): the norm weight g [a*c*d]
// (x's layout), the residual add into y, or silu_mul for the MLP's [gate; up] chain's last factor (a == 1 and b
// even: y [tokens][b/2 * d] = silu(rows j < b/2) * (rows j + b/2), not with accumulate).
bool ksmm_gemv_fusion_supports(int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d, const void* x, const void* w,
                               const void* y, const ProjectionFusion& fusion);
// y [tokens][a*b*d] (silu_mul: [tokens][a*b*d/2]) = the factor applied to x with `fusion`; the shape must pass
// ksmm_gemv_fusion_supports. y must not overlap x. One token with no fusion but the residual add runs on the rows
// kernel where it takes the shape (faster than gemv at one token).
void launch_ksmm_gemv(const void* x, const void* w, void* y, int64_t tokens, int64_t a, int64_t b, int64_t c,
                      int64_t d, const ProjectionFusion& fusion, DType dtype, cudaStream_t stream);

// The sm_90a wgmma kernel (ksmm_wgmma.cu) runs a factor as `groups` independent GEMMs
//     y_g [tokens][b] = x [tokens][g*c .. g*c + c - 1] times w [g][b][c] transposed
// with x [tokens][groups*c] and w [groups][b][c] contiguous. A d = 1 factor (a, b, c, 1) is exactly that with
// groups = a on its natural x and W. A d > 1 factor is that with groups = a*d, g = i*d + l, on x in the factor's
// batch-major order (input (i, k, l) at (i*d + l)*c + k instead of (i*c + k)*d + l) and W in the per-l layout
// [a][d][b][c]. Output (g, r) of a token goes to the factor's natural position (i*b + r)*d + l of y
// [tokens][groups*b] when next_d == 1, else to that position's place in the batch-major order of a next
// factor (a', b', next_c, next_d) of the chain. The permutations live in the TMA coordinates and the store
// addresses. The binding (minfer.ksmm_wgmma) runs a d > 1 factor with next_d == 1, from this d and this
// tokens * d on, with d = 1 here, its GEMMs into the batch-major order (whole 16-byte stores), then one
// block-transpose pass (launch_ksmm_transpose_blocks) moves y to the natural order: the stride-d stores write a
// sector per output; with the passes (and x gathered by the same kernel) the grid's d >= 4 factors on wgmma ran
// 0.93-11.6x faster at 512 and 4096 tokens on the H200 (median 1.4x); at 16 tokens the pass's launch cost more
// than it saved up to d = 16 (docs/perf-notes.md, 2026-11-28).
constexpr int kKsmmWgmmaTransposeMinD = 4;
constexpr int64_t kKsmmWgmmaTransposeMinTokensD = 1024;
bool ksmm_wgmma_available();
// Whether the kernel takes the shape: an sm_90 GPU and a 9.0a build, b and c multiples of kKsmmWgmmaMultiple,
// x, w and y 16-byte aligned, int32 indices.
bool ksmm_wgmma_supports(int64_t tokens, int64_t groups, int64_t b, int64_t c, const void* x, const void* w,
                         const void* y);
// Launches it (tile_n: outputs per tile, 64, 128, 192 or 256; 0 picks by shape); nullptr, or why it did not
// run.
// With next_d > 1, groups*b must be a multiple of next_c*next_d.
const char* launch_ksmm_wgmma(const void* x, const void* w, void* y, int64_t tokens, int64_t groups, int64_t b,
                              int64_t c, int64_t d, int64_t next_c, int64_t next_d, int tile_n, DType dtype,
                              cudaStream_t stream);

// out [matrices][cols][rows] = in [matrices][rows][cols] transposed, 16-bit elements, both contiguous and not
// overlapping: a factor's natural order <-> its batch-major order (rows, cols = c, d or d, c per token and i).
// Takes a long side (rows or cols) that is a multiple of 8 with the other at most 1024, 16-byte aligned tensors.
bool ksmm_transpose_blocks_supports(int64_t rows, int64_t cols, const void* in, const void* out);
void launch_ksmm_transpose_blocks(const void* in, void* out, int64_t matrices, int64_t rows, int64_t cols,
                                  cudaStream_t stream);

}  // namespace minfer
