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

// Which kernel runs a factor. kAuto: rows for one token, gemv up to kKsmmRowsMaxTokens tokens, tensor cores past
// them, generic for what none takes (the first that takes the shape; rows beat gemv at one token on 57 of 61
// grid patterns and gemv beat rows at 16 on all 61, docs/perf-notes.md). The others force one, for tests and
// benchmarks; a kernel refuses what it cannot run.
// - kGemv: the row runs in 16-byte chunks on mma.sync (16 rows x up to 16 tokens), d in {1, 2, 4} or a
//   multiple of 8, c*d a multiple of 8, x and W 16-byte aligned;
// - kRows: the row runs on CUDA cores with fp32 sums per l, d a power of two up to kKsmmRowsMaxD, same
//   alignment;
// - kTensorCore: GEMM tiles per (i, group of l's) on mma.sync, any batch, gemv's shapes, y 16-byte aligned too;
// - kGeneric: one thread per output, anything.
enum class KsmmPath : int { kAuto = 0, kGeneric = 1, kRows = 2, kTensorCore = 3, kGemv = 4 };

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

}  // namespace minfer
