// Hopper (sm_90) pipeline pieces shared by the warp-specialized kernels: mbarriers, TMA tile loads and
// stores, named barriers, setmaxnreg and the wgmma plumbing (sm_90a), and tensor maps through the driver's
// encoder fetched at run time. Included from .cu files only. Framework-free.
#pragma once
#include <cuda.h>  // CUtensorMap and its enums only: the driver entry point is fetched at run time
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "launch.h"

namespace minfer {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}

// Makes barrier initialisation visible to the async proxy (TMA) before the block's barrier.
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Thread 0 initialises a ring's barriers, 8 bytes per stage each: `full` takes one arrival (the producer's
// arrive.expect_tx), `empty` takes `consumer_arrivals`; then makes them visible to TMA.
__device__ __forceinline__ void init_ring_barriers(uint32_t full_bar, uint32_t empty_bar, int stages,
                                                   uint32_t consumer_arrivals) {
    if (threadIdx.x != 0) return;
    for (int s = 0; s < stages; ++s) {
        mbar_init(full_bar + 8 * s, 1);
        mbar_init(empty_bar + 8 * s, consumer_arrivals);
    }
    fence_mbarrier_init();
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

// Box at coordinates (c0 innermost, c1, c2) of a 3-D tensor map -> shared memory; completes on `bar`.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}],"
        " [%5];\n" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}

// Box at (c0 = column, c1 = row) of a 2-D tensor map -> shared memory; completes on `bar`.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
            "r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}

// Shared memory -> box at (c0, c1); the parts of the box outside the tensor are not written.
__device__ __forceinline__ void tma_store(const CUtensorMap* map, uint32_t src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(map), "r"(c0),
                 "r"(c1), "r"(src)
                 : "memory");
}

__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Waits until at most N committed stores still read their shared-memory source.
template <int N> __device__ __forceinline__ void tma_store_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void tma_store_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Orders this thread's ordinary shared-memory writes before later async-proxy (TMA) reads.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Four 8x8 b16 matrices from registers to shared memory; lanes 8q..8q+7 give the row addresses of matrix q.
// TRANS stores each matrix transposed: a lane's pair (row lane / 4, columns 2 (lane % 4) + {0, 1}) lands
// in rows 2 (lane % 4) + {0, 1}, column lane / 4.
template <bool TRANS = false>
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    if constexpr (TRANS) {
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
                     "r"(r1), "r"(r2), "r"(r3)
                     : "memory");
    } else {
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
                     "r"(r1), "r"(r2), "r"(r3)
                     : "memory");
    }
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across a wgmma wait.
template <int R> __device__ __forceinline__ void fence_registers(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor for a K-major operand in the swizzled layout TMA writes with rows of
// SWIZZLE bytes (128 or 64): groups of 8 rows 8 * SWIZZLE bytes apart (stride byte offset); the leading
// byte offset is unused when the instruction's K lies inside one swizzle row. Adding 2 to the descriptor
// steps 32 bytes along K.
template <int SWIZZLE = 128>
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t addr) {
    static_assert(SWIZZLE == 128 || SWIZZLE == 64, "128- or 64-byte swizzle");
    constexpr uint64_t kLayout = SWIZZLE == 128 ? 1 : 2;  // the descriptor's layout-type field
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) |
           (static_cast<uint64_t>(8 * SWIZZLE >> 4) << 32) | (kLayout << 62);
}

// PTX names every accumulator register of a wgmma, so the operand lists are written out.
#define MINFER_WGMMA_REGS0                                                         \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MINFER_WGMMA_REGS1                                                                  \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MINFER_WGMMA_REGS2                                                                  \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define MINFER_WGMMA_REGS3                                                                           \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define MINFER_F8(i) \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define MINFER_F32(i) MINFER_F8(i), MINFER_F8(i + 8), MINFER_F8(i + 16), MINFER_F8(i + 24)
// WGMMA("f16", ...) or WGMMA("bf16", ...) for the element type T in scope (half or __nv_bfloat16).
#define MINFER_WGMMA_BY_TYPE(WGMMA, ...)                       \
    do {                                                       \
        if constexpr (std::is_same_v<T, half>) {               \
            WGMMA("f16", __VA_ARGS__);                         \
        } else {                                               \
            WGMMA("bf16", __VA_ARGS__);                        \
        }                                                      \
    } while (0)

// Named barrier `id` over `threads` threads: sync waits for all of them, arrive only counts itself.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// One output box of a consumer warpgroup through a swizzled shared buffer: once the TMA store that last read
// `buf` is done with it, `fill()` writes it (all 128 threads of the warpgroup, named barrier `barrier`), then the
// `leader` thread stores it to (c0, c1) of `map`.
template <class Fill>
__device__ __forceinline__ void store_box(const CUtensorMap* map, uint32_t buf, int c0, int c1, int barrier,
                                          bool leader, Fill&& fill) {
    if (leader) tma_store_wait_read<1>();
    named_barrier_sync(barrier, 128);
    fill();
    fence_proxy_async();
    named_barrier_sync(barrier, 128);
    if (leader) {
        tma_store(map, buf, c0, c1);
        tma_store_commit();
    }
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
// one swizzle row; swizzle_bytes 64: rows of 32 elements): dims innermost first, byte_strides for dims 1 ..,
// box per dim. Elements outside the tensor load as zeros and are not stored. False when the driver has no
// encoder or refuses the map.
inline bool encode_swizzled_map(CUtensorMap* map, const void* ptr, DType dtype, int rank, const cuuint64_t* dims,
                                const cuuint64_t* byte_strides, const cuuint32_t* box, int swizzle_bytes = 128) {
    const EncodeTiled encode = encode_tiled();
    if (encode == nullptr) return false;
    const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
    const CUtensorMapDataType type =
        dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    return encode(map, type, rank, const_cast<void*>(ptr), dims, byte_strides, box, element_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE,
                  swizzle_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// 2-D map over a row-major [rows, cols] matrix of 16-bit elements with `row_bytes` between rows, boxes of
// box_rows x (swizzle_bytes / 2) columns; elements outside the matrix load as zeros and are not stored.
inline bool make_map(CUtensorMap* map, const void* ptr, DType dtype, int rows, int cols, int64_t row_bytes,
                     int box_rows, int swizzle_bytes = 128) {
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
    const cuuint64_t row_stride[1] = {static_cast<cuuint64_t>(row_bytes)};
    const cuuint32_t box[2] = {static_cast<cuuint32_t>(swizzle_bytes / 2), static_cast<cuuint32_t>(box_rows)};
    return encode_swizzled_map(map, ptr, dtype, 2, dims, row_stride, box, swizzle_bytes);
}

}  // namespace minfer
