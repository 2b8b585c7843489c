// One block per row, a single pass: each thread scans 16-byte chunks (kUnroll loads in flight) in
// increasing index order, then a warp-shuffle and a shared-memory reduction of (value, index) pairs.
// A chunk is scanned element by element only when its packed maximum can beat the thread's best,
// which after the first few chunks almost never happens: about one instruction per element.
#include <climits>

#include "argmax.h"
#include "common/device_utils.cuh"

namespace minfer {

namespace {

constexpr int kThreads = 1024;
constexpr int kUnroll = 4;
constexpr int kNoIndex = INT_MAX;  // a thread that saw only -inf keeps it

struct Best {
    float value;
    int index;
};

// A thread sees indices in increasing order, so a later element wins only when it is strictly
// larger, or NaN while the best so far is not (torch.argmax: NaN beats every number, first one wins).
__device__ __forceinline__ bool later_beats(float value, float best) {
    return !(value <= best) && best == best;
}

// Between threads the index decides ties.
__device__ __forceinline__ bool beats(const Best& a, const Best& b) {
    const bool a_nan = a.value != a.value, b_nan = b.value != b.value;
    if (a_nan || b_nan) return a_nan && (!b_nan || a.index < b.index);
    return a.value > b.value || (a.value == b.value && a.index < b.index);
}

// Largest value of a chunk, NaN if it holds one; float rows skip the filter.
template <typename T> __device__ __forceinline__ float chunk_max(const uint4& chunk);

template <>
__device__ __forceinline__ float chunk_max<half>(const uint4& chunk) {
    const half2* v = reinterpret_cast<const half2*>(&chunk);
    const half2 m = __hmax2_nan(__hmax2_nan(v[0], v[1]), __hmax2_nan(v[2], v[3]));
    return to_float(__hmax_nan(__low2half(m), __high2half(m)));
}

template <>
__device__ __forceinline__ float chunk_max<__nv_bfloat16>(const uint4& chunk) {
    const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&chunk);
    const __nv_bfloat162 m = __hmax2_nan(__hmax2_nan(v[0], v[1]), __hmax2_nan(v[2], v[3]));
    return to_float(__hmax_nan(__low2bfloat16(m), __high2bfloat16(m)));
}

template <>
__device__ __forceinline__ float chunk_max<float>(const uint4&) {
    return NAN;
}

template <typename T>
__device__ __forceinline__ void offer_chunk(Best& best, const uint4& chunk, int first_index) {
    constexpr int kPerChunk = 16 / sizeof(T);
    if (!later_beats(chunk_max<T>(chunk), best.value)) return;
    const T* values = reinterpret_cast<const T*>(&chunk);
#pragma unroll
    for (int i = 0; i < kPerChunk; ++i) {
        const float v = to_float(values[i]);
        if (later_beats(v, best.value)) best = {v, first_index + i};
    }
}

__device__ __forceinline__ Best warp_best(Best best) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const Best other{__shfl_xor_sync(0xffffffffu, best.value, offset),
                         __shfl_xor_sync(0xffffffffu, best.index, offset)};
        if (beats(other, best)) best = other;
    }
    return best;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    argmax_kernel(const T* logits, int64_t* __restrict__ out, int vocab, TokenHandoff handoff) {
    allow_dependents_to_launch();
    wait_for_previous_kernel();  // the logits come from the previous kernel: coherent loads below
    constexpr int kPerChunk = 16 / sizeof(T);
    const T* row = logits + (int64_t)blockIdx.x * vocab;
    Best best{-INFINITY, kNoIndex};

    // 16-byte chunks when the row is aligned; the elements left over one by one, after them.
    int scalar_start = 0;
    if (reinterpret_cast<uintptr_t>(row) % 16 == 0) {
        const uint4* chunks = reinterpret_cast<const uint4*>(row);
        const int num_chunks = vocab / kPerChunk;
        int c = threadIdx.x;
        for (; c + (kUnroll - 1) * kThreads < num_chunks; c += kUnroll * kThreads) {
            uint4 loaded[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) loaded[u] = load_coherent_16B(chunks + c + u * kThreads);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) offer_chunk<T>(best, loaded[u], (c + u * kThreads) * kPerChunk);
        }
        for (; c < num_chunks; c += kThreads) offer_chunk<T>(best, load_coherent_16B(chunks + c), c * kPerChunk);
        scalar_start = num_chunks * kPerChunk;
    }
    for (int i = scalar_start + threadIdx.x; i < vocab; i += kThreads) {
        const float v = to_float(row[i]);
        if (later_beats(v, best.value)) best = {v, i};
    }

    __shared__ Best per_warp[kThreads / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    best = warp_best(best);
    if (lane == 0) per_warp[warp] = best;
    __syncthreads();
    if (warp != 0) return;
    best = warp_best(per_warp[lane]);
    // Nothing beat -inf and nothing was NaN: every logit is -inf, and the first one wins.
    if (lane != 0) return;
    const int64_t token = best.index == kNoIndex ? 0 : best.index;
    out[blockIdx.x] = token;
    if (handoff.host_tokens) {
        const int64_t position = *handoff.position;  // advanced only here, by the previous step's argmax
        if (position + 1 >= 0 && position + 1 < handoff.capacity) handoff.host_tokens[position + 1] = token;
        __threadfence_system();  // the token reaches host memory before the host can see this kernel done
        *handoff.position = position + 1;
    }
}

template <typename T>
void launch_typed(const void* logits, int64_t* out, int64_t rows, int64_t vocab, const TokenHandoff& handoff,
                  cudaStream_t stream) {
    launch_with_pdl(argmax_kernel<T>, dim3((unsigned)rows), dim3(kThreads), 0, stream, true,
                    static_cast<const T*>(logits), out, (int)vocab, handoff);
}

}  // namespace

void launch_argmax(const void* logits, int64_t* out, int64_t rows, int64_t vocab, DType dtype,
                   const TokenHandoff& handoff, cudaStream_t stream) {
    switch (dtype) {
        case DType::kFloat16: launch_typed<half>(logits, out, rows, vocab, handoff, stream); break;
        case DType::kBFloat16: launch_typed<__nv_bfloat16>(logits, out, rows, vocab, handoff, stream); break;
        case DType::kFloat32: launch_typed<float>(logits, out, rows, vocab, handoff, stream); break;
    }
}

}  // namespace minfer
