// Decode GEMV: out[t, n] = sum_k w[n, k] * x[t, k] for 1..8 tokens; w is row-major [N, K] (HF layout).
#pragma once
#include "launch.h"

namespace minfer {

// The tensor-core path feeds the tokens as the n=8 side of mma.m16n8k16, so 8 is the ceiling.
constexpr int kGemvMaxTokens = 8;

// Launch configuration of the tensor-core path; 0 picks the measured default for the shape.
struct GemvTuning {
    int warps_per_block = 0;  // 4, 8 or 16 warps sharing one 16-row tile's K range
    int unroll = 0;           // 16x32 warp steps per load batch: 2, 4 or 8 (at most 4 with 16 warps)
};

// What the GEMV multiplies by. On the decode path the norm before a projection and the SiLU-mul
// before the down projection are computed while x is staged in shared memory: one kernel boundary
// less each, on a step made of ~10 us kernels.
enum class GemvPrologue : int {
    kNone = 0,        // x [T, K] as given
    kAddRmsNorm = 1,  // h = residual + x (rounded to T), written to residual_out; x' = rms_norm(h) * norm_weight
    kSiluMul = 2,     // x is gate_up [T, 2K]; x' = silu(gate) * up
};

struct GemvPrologueArgs {
    GemvPrologue kind = GemvPrologue::kNone;
    const void* residual = nullptr;     // kAddRmsNorm: [T, K]
    void* residual_out = nullptr;       // kAddRmsNorm: [T, K], must not overlap residual or x
    const void* norm_weight = nullptr;  // kAddRmsNorm: [K]
    float eps = 0.0f;
};

// x [tokens, k], w [n, k], out [tokens, n]; float16 or bfloat16, fp32 accumulation.
// K a multiple of 8 with 16-byte aligned x and w takes the fast path; anything else a scalar one.
// A prologue needs the fast path's alignment (residual, residual_out and norm_weight too) and its
// staged x (tokens * k elements) within the device's shared memory; returns false otherwise.
bool launch_gemv(const void* x, const void* w, void* out, int64_t tokens, int64_t n, int64_t k, DType dtype,
                 const GemvTuning& tuning, const GemvPrologueArgs& prologue, cudaStream_t stream);

}  // namespace minfer
