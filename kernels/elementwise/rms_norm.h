// RMSNorm with HF LlamaRMSNorm numerics, optionally fused with the residual add.
#pragma once
#include "common/launch.h"

namespace minfer {

// out[r, :] = weight * to_dtype(x[r, :] * rsqrt(mean(x[r, :]^2) + eps)), variance in fp32.
// With residual != nullptr: residual[r, :] = to_dtype(residual + x) first, and that sum is normalised.
// The row stays in registers: up to 4 16-byte packs per thread when the row length and pointers
// allow 16-byte access, else 16 elements, with 512 threads. Returns false, launching nothing,
// for a longer row (over 16384 fp16/bf16 or 8192 fp32 elements, or 8192 unaligned ones).
bool launch_rms_norm(const void* x, void* residual, const void* weight, void* out, int64_t rows,
                     int64_t hidden, float eps, DType dtype, cudaStream_t stream);

}  // namespace minfer
