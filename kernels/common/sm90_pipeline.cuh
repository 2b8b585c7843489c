// Hopper (sm_90) pipeline pieces shared by the warp-specialized kernels: mbarriers, TMA tile loads,
// named barriers, setmaxnreg (sm_90a), and tensor maps through the driver's encoder fetched at run time.
// Included from .cu files only. Framework-free.
#pragma once
#include <cuda.h>  // CUtensorMap and its enums only: the driver entry point is fetched at run time
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "launch.h"

namespace minfer {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}

// Makes barrier initialisation visible to the async proxy (TMA) before the block's barrier.
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also announces `bytes` of TMA traffic to come.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Waits until the phase with this parity has completed. A fresh barrier counts its phase
// "before 0" (parity 1) as complete, so a producer's first pass over its ring does not wait.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// Box at coordinates (c0 innermost .. c3) of a 4-D tensor map -> shared memory; completes on `bar`.
// Elements outside the tensor load as zeros and still count toward the barrier's bytes.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}],"
        " [%6];\n" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// Named barrier `id` over `threads` threads: sync waits for all of them, arrive only counts itself.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <int R> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}

template <int R> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}

using EncodeTiled = PFN_cuTensorMapEncodeTiled_v12000;

// cuTensorMapEncodeTiled from the driver, or nullptr when the driver has none.
inline EncodeTiled encode_tiled() {
    static const EncodeTiled fn = [] {
        void* p = nullptr;
        cudaDriverEntryPointQueryResult found;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found) !=
                cudaSuccess ||
            found != cudaDriverEntryPointSuccess)
            return static_cast<EncodeTiled>(nullptr);
        return reinterpret_cast<EncodeTiled>(p);
    }();
    return fn;
}

// A tensor map over float16 / bfloat16 elements with the 128-byte swizzle (a box row of 64 elements is
// one swizzle row): dims innermost first, byte_strides for dims 1 .., box per dim. Elements outside the
// tensor load as zeros and are not stored. False when the driver has no encoder or refuses the map.
inline bool encode_swizzled_map(CUtensorMap* map, const void* ptr, DType dtype, int rank, const cuuint64_t* dims,
                                const cuuint64_t* byte_strides, const cuuint32_t* box) {
    const EncodeTiled encode = encode_tiled();
    if (encode == nullptr) return false;
    const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
    const CUtensorMapDataType type =
        dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    return encode(map, type, rank, const_cast<void*>(ptr), dims, byte_strides, box, element_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace minfer
