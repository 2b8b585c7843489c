// Kronecker-sparse (KS) factors (docs/FORMATS.md, "Kronecker-sparse factors"): one fused kernel per factor.
// A factor of pattern (a, b, c, d) is W [a][b][c][d]; for a batch-first x [tokens][a*c*d] it writes
//     y[n][(i*b + j)*d + l] = sum_k x[n][(i*c + k)*d + l] * W[i][j][k][l]
// reading x with the stride-d gather and writing y with the stride-d scatter in place (no permutation pass),
// fp16/bf16 in and out, fp32 accumulation. Framework-free launchers.
#pragma once
#include "common/launch.h"

namespace minfer {

// Up to this many tokens the bandwidth path runs: each weight is read once, every token's products summed
// in registers (a segmented GEMV: W[i][j][:][:] and x[n][i][:][:] are contiguous c*d runs).
constexpr int kKsmmRowsMaxTokens = 16;
// The bandwidth path keeps d sums per token of a row; it takes d a power of two up to this.
constexpr int kKsmmRowsMaxD = 64;

// Which kernel runs a factor. kAuto picks by the heuristic in ksmm.cu (tokens, the pattern, the SM count);
// the others force one for tests and benchmarks, and a kernel that cannot take the shape refuses it.
enum class KsmmPath : int { kAuto = 0, kGeneric = 1, kRows = 2, kTensorCore = 3 };

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

}  // namespace minfer
