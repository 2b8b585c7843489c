// Hopper (sm_90+) asynchronous-copy and cluster primitives: mbarriers, bulk copies (TMA) into
// shared memory, cluster rank and barriers. Include from .cu files only; the bodies compile to
// nothing before sm_90, so callers guard their own use.
#pragma once
#include <cstdint>

namespace minfer {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MINFER_SM90_ASYNC 1
#endif

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#ifdef MINFER_SM90_ASYNC
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
#endif
}

// Makes this thread's mbarrier.init visible to the async proxy and to the cluster.
__device__ __forceinline__ void fence_mbarrier_init() {
#ifdef MINFER_SM90_ASYNC
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// One arrival that also announces `bytes` of TMA traffic to come.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#ifdef MINFER_SM90_ASYNC
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#ifdef MINFER_SM90_ASYNC
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
#endif
}

// Waits until the phase with this parity has completed. A fresh barrier counts its phase
// "before 0" (parity 1) as complete, so a producer's first pass over a ring does not wait.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#ifdef MINFER_SM90_ASYNC
    uint32_t done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
#endif
}

// `bytes` (a multiple of 16, 16-byte aligned at both ends) global -> this CTA's shared memory,
// counted on `bar` as they land.
__device__ __forceinline__ void bulk_copy_to_shared(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
#ifdef MINFER_SM90_ASYNC
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
#endif
}

// Orders this thread's ordinary shared-memory writes before later async-proxy (TMA) reads.
__device__ __forceinline__ void fence_proxy_async() {
#ifdef MINFER_SM90_ASYNC
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t rank = 0;
#ifdef MINFER_SM90_ASYNC
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
#endif
    return rank;
}

// Every thread of every CTA in the cluster; orders shared-memory writes (local and remote) cluster-wide.
__device__ __forceinline__ void cluster_sync() {
#ifdef MINFER_SM90_ASYNC
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// The address of `local` (this CTA's shared memory) in CTA `cta` of the cluster.
__device__ __forceinline__ uint32_t cluster_peer_address(uint32_t local, uint32_t cta) {
    uint32_t remote = local;
#ifdef MINFER_SM90_ASYNC
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(cta));
#endif
    return remote;
}

__device__ __forceinline__ void store_cluster_f32x4(uint32_t addr, float4 v) {
#ifdef MINFER_SM90_ASYNC
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(v.x), "f"(v.y), "f"(v.z),
                 "f"(v.w)
                 : "memory");
#endif
}

__device__ __forceinline__ void store_cluster_f32(uint32_t addr, float v) {
#ifdef MINFER_SM90_ASYNC
    asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
#endif
}

}  // namespace minfer
