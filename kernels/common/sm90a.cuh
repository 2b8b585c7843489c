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

// A consumer warpgroup's k-blocks of one output tile, both operands K-major in the 128-byte-swizzled stages of
// a ring of S (A's 64 rows at a_offset, B's BN rows at b_offset inside a stage of STAGE_BYTES): for each, wait
// until stage it % S is full, issue its KBK / 16 k16 steps, and once the previous k-block's wgmmas are done hand
// that stage back with release(stage); after the last, wait for all and release its stage too. `it` counts the
// k-blocks this warpgroup consumed over all its tiles.
template <int BN, typename T, int S, int STAGE_BYTES, int KBK, class Release>
__device__ __forceinline__ void consume_k_blocks(float (&acc)[BN / 2], int& it, int num_k, uint32_t base,
                                                 uint32_t full_bar, uint32_t a_offset, uint32_t b_offset,
                                                 Release&& release) {
    for (int kb = 0; kb < num_k; ++kb, ++it) {
        const int s = it % S;
        mbar_wait(full_bar + 8 * s, (it / S) & 1);
        const uint32_t stage = base + s * STAGE_BYTES;
        const uint64_t desc_a = smem_descriptor(stage + a_offset);
        const uint64_t desc_b = smem_descriptor(stage + b_offset);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < KBK / 16; ++k) wgmma_k16<BN, T>(acc, desc_a + 2 * k, desc_b + 2 * k, kb > 0 || k > 0);
        wgmma_commit();
        if (kb > 0) {  // the previous k-block's wgmmas are done: hand its stage back
            wgmma_wait<1>();
            release((it - 1) % S);
        }
    }
    wgmma_wait<0>();
    fence_registers(acc);
    release((it - 1) % S);
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
