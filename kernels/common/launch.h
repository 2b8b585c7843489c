// Host-side types shared by every launcher declaration. Framework-free: CUDA runtime only.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace minfer {

inline int current_device() {
    int device = 0;
    cudaGetDevice(&device);
    return device & 63;
}

// The SM count of `device`, asked once (no runtime query while a CUDA graph is being captured).
inline int multiprocessors(int device) {
    static std::atomic<int> cached[64] = {};
    int sms = cached[device].load(std::memory_order_relaxed);
    if (sms == 0) {
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
        cached[device].store(sms, std::memory_order_relaxed);
    }
    return sms;
}

// Element types the kernels are instantiated for.
enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

// What a decode projection kernel (GEMV, MACKO SpMV) may fuse around y = W x, so that a Llama
// sublayer needs no separate RMSNorm or residual-add kernel:
// - norm_weight g (same dtype, [K]): y = (W (g * x)) * rsqrt(mean(x^2) + eps) per token, i.e. W applied
//   to RMSNorm(x); the mean of squares is accumulated from the x the kernel loads anyway and applied
//   in the epilogue, so nothing runs before the main loop;
// - accumulate: out += y in place (the residual add), instead of out = y;
// - silu_mul (GEMV only, not with accumulate): W's rows are [gate; up] (N = 2I) and out [tokens, I]
//   receives silu(gate) * up, so the MLP needs no activation kernel either.
struct ProjectionFusion {
    const void* norm_weight = nullptr;
    float eps = 0.0f;
    bool accumulate = false;
    bool silu_mul = false;
};

}  // namespace minfer
