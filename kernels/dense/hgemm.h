// HGEMM for prefill: y[M, N] = x[M, K] @ w[N, K]^T, w in the HF [out, in] layout, fp32 accumulation.
// Two paths: wgmma + TMA on sm_90a (hgemm_sm90.cu), mma.sync + cp.async on sm_80+ (hgemm_sm80.cu).
// Rows of x, w and y must start on 16 bytes: N and K multiples of 8, base pointers 16-byte aligned.
#pragma once
#include "common/launch.h"

namespace minfer {

// Kernel names: "auto" picks by device and shape; "sm80" / "sm90" pin a path and let it pick the tile;
// "sm80_64x128", "sm80_128x128", "sm90_128x64", "sm90_128x128", "sm90_128x192", "sm90_128x256" pin
// one tile (BMxBN), and "sm90_128x128_c2", "sm90_128x192_c2", "sm90_128x256_c2" one tile run by
// clusters of 2 CTAs that share W loads, for tests and benchmarks. Returns nullptr on success,
// else what is wrong.
const char* launch_hgemm(const void* x, const void* w, void* y, int64_t m, int64_t n, int64_t k, DType dtype,
                         const char* kernel, cudaStream_t stream);

// The per-path launchers behind it. tile 0 lets the path choose; otherwise the tile's M (sm80) or N
// (sm90), and for sm90 the cluster size (1 or 2).
const char* launch_hgemm_sm80(const void* x, const void* w, void* y, int m, int n, int k, DType dtype, int tile_m,
                              cudaStream_t stream);
const char* launch_hgemm_sm90(const void* x, const void* w, void* y, int m, int n, int k, DType dtype, int tile_n,
                              int cluster, cudaStream_t stream);

// True when the current device is an sm_90 part and this build holds the sm_90a kernels for it.
bool hgemm_sm90_available();

}  // namespace minfer
