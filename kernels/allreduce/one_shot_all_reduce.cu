// One block per chunk of 256 16-byte vectors: a decode step's hidden vector (8-16 KB) takes 2-4 blocks,
// whose flag exchanges and peer reads run in parallel. Peer slots are read with volatile loads (no L1:
// the same addresses were read two calls ago).
#include "allreduce/one_shot_all_reduce.h"
#include "common/device_utils.cuh"

namespace minfer {

namespace {

constexpr int kThreads = kAllReduceThreads;

__device__ __forceinline__ void raise_flag(uint32_t* flag, uint32_t value) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
}

__device__ __forceinline__ uint32_t read_flag(const uint32_t* flag) {
    uint32_t value;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
    return value;
}

__device__ __forceinline__ uint4 load_peer_16B(const void* ptr) {
    uint4 r;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(ptr)
                 : "memory");
    return r;
}

template <typename T>
__device__ __forceinline__ void add_vector(float (&sum)[16 / sizeof(T)], const uint4& v) {
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < 16 / (int)sizeof(T); ++i) sum[i] += to_float(e[i]);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) one_shot_all_reduce_kernel(const uint4* src, uint4* dst, int64_t vectors,
                                                                       PeerBuffers peers) {
    __shared__ uint32_t epoch;
    const int block = blockIdx.x;
    const int64_t v = (int64_t)block * kThreads + threadIdx.x;
    wait_for_previous_kernel();
    allow_dependents_to_launch();  // the next projection streams its weights in while the flags cross
    if (threadIdx.x == 0) epoch = peers.epochs[block] + 1;
    __syncthreads();
    const uint32_t e = epoch;
    const int64_t slot = (int64_t)(e & 1) * peers.slot_bytes;
    if (v < vectors) {
        uint4* mine = reinterpret_cast<uint4*>(static_cast<char*>(peers.buffers[peers.rank]) + slot);
        mine[v] = src[v];
    }
    __syncthreads();
    const int peer = threadIdx.x;
    if (peer < peers.world_size && peer != peers.rank) {
        __threadfence_system();
        raise_flag(peers.signals[peer] + block * kAllReduceMaxRanks + peers.rank, e);
        const uint32_t* theirs = peers.signals[peers.rank] + block * kAllReduceMaxRanks + peer;
        while (read_flag(theirs) < e) {
        }
    }
    __syncthreads();
    if (v < vectors) {
        float sum[16 / sizeof(T)] = {};
        for (int r = 0; r < peers.world_size; ++r) {
            const char* slot_of_r = static_cast<const char*>(peers.buffers[r]) + slot;
            add_vector<T>(sum, load_peer_16B(reinterpret_cast<const uint4*>(slot_of_r) + v));
        }
        uint4 out;
        T* e_out = reinterpret_cast<T*>(&out);
#pragma unroll
        for (int i = 0; i < 16 / (int)sizeof(T); ++i) e_out[i] = from_float<T>(sum[i]);
        dst[v] = out;
    }
    if (threadIdx.x == 0) peers.epochs[block] = e;
}

template <typename T>
void launch_typed(const void* src, void* dst, int64_t numel, const PeerBuffers& peers, cudaStream_t stream) {
    const int64_t vectors = numel * (int64_t)sizeof(T) / 16;
    const int blocks = (int)((vectors + kThreads - 1) / kThreads);
    launch_with_pdl(one_shot_all_reduce_kernel<T>, dim3(blocks), dim3(kThreads), 0, stream, true,
                    static_cast<const uint4*>(src), static_cast<uint4*>(dst), vectors, peers);
}

}  // namespace

void launch_one_shot_all_reduce(const void* src, void* dst, int64_t numel, DType dtype, const PeerBuffers& peers,
                                cudaStream_t stream) {
    if (numel == 0) return;
    switch (dtype) {
        case DType::kFloat16: return launch_typed<half>(src, dst, numel, peers, stream);
        case DType::kBFloat16: return launch_typed<__nv_bfloat16>(src, dst, numel, peers, stream);
        case DType::kFloat32: return launch_typed<float>(src, dst, numel, peers, stream);
    }
}

}  // namespace minfer
