// For .cu files whose kernels need sm_90a (wgmma, setmaxnreg): a plain sm_90 device pass is refused,
// MINFER_SM90A marks the pass that has the sm_90a features, and sm90a_kernel_available() is the run-time
// check that such a kernel can run on the current device. Included from .cu files only.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>

#include "sm90_pipeline.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "this file's kernels need the sm_90a target (wgmma, setmaxnreg): build for Hopper with TORCH_CUDA_ARCH_LIST=9.0a"
#endif
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MINFER_SM90A 1
#endif

namespace minfer {

#ifdef MINFER_SM90A

// D (64 x N, fp32) = A (64 x 16) * B (16 x N) + scale_d * D; DA, DB, SD: operand numbers of the
// descriptors and of scale_d, which follow the N / 2 accumulators.
#define MINFER_WGMMA(TYPE, SHAPE, REGS, DA, DB, SD, ...)                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" SD ", 0;\nwgmma.mma_async.sync.aligned." SHAPE         \
                 ".f32." TYPE "." TYPE " {" REGS "}, %" DA ", %" DB ", p, 1, 1, 0, 0;\n}\n"                 \
                 : __VA_ARGS__                                                                             \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d))
#define MINFER_WGMMA_TYPED(...) MINFER_WGMMA_BY_TYPE(MINFER_WGMMA, __VA_ARGS__)

template <int BN, typename T>
__device__ __forceinline__ void wgmma_k16(float (&d)[BN / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    if constexpr (BN == 64) {
        MINFER_WGMMA_TYPED("m64n64k16", MINFER_WGMMA_REGS0, "32", "33", "34", MINFER_F32(0));
    } else if constexpr (BN == 128) {
        MINFER_WGMMA_TYPED("m64n128k16", MINFER_WGMMA_REGS0 ", " MINFER_WGMMA_REGS1, "64", "65", "66", MINFER_F32(0),
                           MINFER_F32(32));
    } else if constexpr (BN == 192) {
        MINFER_WGMMA_TYPED("m64n192k16", MINFER_WGMMA_REGS0 ", " MINFER_WGMMA_REGS1 ", " MINFER_WGMMA_REGS2, "96",
                           "97", "98", MINFER_F32(0), MINFER_F32(32), MINFER_F32(64));
    } else {
        static_assert(BN == 256, "tile N is 64, 128, 192 or 256");
        MINFER_WGMMA_TYPED("m64n256k16",
                           MINFER_WGMMA_REGS0 ", " MINFER_WGMMA_REGS1 ", " MINFER_WGMMA_REGS2 ", " MINFER_WGMMA_REGS3,
                           "128", "129", "130", MINFER_F32(0), MINFER_F32(32), MINFER_F32(64), MINFER_F32(96));
    }
}

#endif  // MINFER_SM90A

// True when the current device is an sm_90 part, `Kernel` holds sm_90 machine code compiled from sm_90a
// PTX (the #error above rules out plain sm_90), and the driver can encode tensor maps. Asked once per device.
template <auto Kernel>
bool sm90a_kernel_available() {
    static std::atomic<int> cached[64] = {};  // 0 unknown, 1 no, 2 yes
    const int device = current_device();
    int state = cached[device].load(std::memory_order_relaxed);
    if (state == 0) {
        cudaDeviceProp prop;
        cudaFuncAttributes attr;
        const bool ok = cudaGetDeviceProperties(&prop, device) == cudaSuccess && prop.major == 9 && prop.minor == 0 &&
                        cudaFuncGetAttributes(&attr, Kernel) == cudaSuccess && attr.binaryVersion == 90 &&
                        attr.ptxVersion >= 90 && encode_tiled() != nullptr;
        state = ok ? 2 : 1;
        cached[device].store(state, std::memory_order_relaxed);
    }
    return state == 2;
}

}  // namespace minfer
