// wgmma (sm_90a) pieces of the block-sparse prefill kernel: fences, shared-memory matrix descriptors
// and the three instruction shapes it issues. Framework-free; included by blocksparse_attention.cuh.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace minfer {
namespace blocksparse {

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed wgmma groups are still in flight.
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across a wgmma wait.
template <int R>
__device__ __forceinline__ void fence_accumulators(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The same for a register A operand: its registers stay untouched until the wait that covers its wgmma.
template <int R>
__device__ __forceinline__ void fence_operands(uint32_t (&a)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// Orders this thread's generic-proxy writes to shared memory (cp.async included) before wgmma reads.
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Descriptor of a tile in 64-column panels of 128-byte rows with the 128-byte swizzle, 8-row groups 1024
// bytes apart (the stride byte offset). The leading byte offset is the distance between panels for an
// N-major operand (the instruction's N may span several panels); K-major operands ignore it (1 by
// convention), their 16-element K step lying inside one 128-byte row.
__device__ __forceinline__ uint64_t panel_descriptor(uint32_t addr, uint32_t leading_bytes) {
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
           (static_cast<uint64_t>((leading_bytes & 0x3FFFF) >> 4) << 16) |
           (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ uint64_t k_major_descriptor(uint32_t addr) { return panel_descriptor(addr, 16); }

// PTX names every accumulator register of a wgmma, so the operand lists are spelled out.
#define MINFER_BSA_REGS32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MINFER_BSA_REGS64 MINFER_BSA_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MINFER_BSA_ACC8(i) \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define MINFER_BSA_ACC32(i) MINFER_BSA_ACC8(i), MINFER_BSA_ACC8(i + 8), MINFER_BSA_ACC8(i + 16), MINFER_BSA_ACC8(i + 24)
// The element type's PTX name, for the instruction strings below.
#define MINFER_BSA_TYPED(WGMMA)                  \
    do {                                         \
        if constexpr (std::is_same_v<T, half>) { \
            WGMMA("f16");                        \
        } else {                                 \
            WGMMA("bf16");                       \
        }                                        \
    } while (0)

// S (64 x 64, fp32) = A (64 x 16, shared, K-major) * B (16 x 64, shared, K-major) (+ S when accumulate).
template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#define MINFER_BSA_SS(TYPE)                                                                                     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE   \
                 "." TYPE " {" MINFER_BSA_REGS32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"                                \
                 : MINFER_BSA_ACC32(0)                                                                          \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate))
    MINFER_BSA_TYPED(MINFER_BSA_SS);
#undef MINFER_BSA_SS
}

// O (64 x N, fp32) += A (64 x 16, registers) * B (16 x N, shared, N-major: imm-trans-b = 1). The operand
// numbers of A's registers, the descriptor and the always-true scale-d follow the N / 2 accumulators.
#define MINFER_BSA_RS(TYPE, SHAPE, REGS, A0, A1, A2, A3, DESC, ONE, ...)                                       \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" ONE ", 0;\nwgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE \
                 "." TYPE " {" REGS "}, {%" A0 ", %" A1 ", %" A2 ", %" A3 "}, %" DESC ", p, 1, 1, 1;\n}\n"         \
                 : __VA_ARGS__                                                                                 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))

template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
#define MINFER_BSA_RS64(TYPE) \
    MINFER_BSA_RS(TYPE, "m64n64k16", MINFER_BSA_REGS32, "32", "33", "34", "35", "36", "37", MINFER_BSA_ACC32(0))
    MINFER_BSA_TYPED(MINFER_BSA_RS64);
#undef MINFER_BSA_RS64
}

template <typename T>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
#define MINFER_BSA_RS128(TYPE)                                                                          \
    MINFER_BSA_RS(TYPE, "m64n128k16", MINFER_BSA_REGS64, "64", "65", "66", "67", "68", "69", MINFER_BSA_ACC32(0), \
                  MINFER_BSA_ACC32(32))
    MINFER_BSA_TYPED(MINFER_BSA_RS128);
#undef MINFER_BSA_RS128
}

}  // namespace blocksparse
}  // namespace minfer
