// Decode GEMV: out[t, n] = sum_k w[n, k] * x[t, k] for 1..8 tokens; w is row-major [N, K] (HF layout).
#pragma once
#include "launch.h"

namespace minfer {

// The tensor-core path feeds the tokens as the n=8 side of mma.m16n8k16, so 8 is the ceiling.
constexpr int kGemvMaxTokens = 8;

// x [tokens, k], w [n, k], out [tokens, n]; float16 or bfloat16, fp32 accumulation.
// K a multiple of 8 with 16-byte aligned x and w takes the fast path; anything else a scalar one.
void launch_gemv(const void* x, const void* w, void* out, int64_t tokens, int64_t n, int64_t k, DType dtype,
                 cudaStream_t stream);

}  // namespace minfer
