// Device helpers shared by the kernels (included from .cu files only). Framework-free.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "launch.h"

namespace minfer {

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<half>(half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ half from_float<half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// A 16-bit pair (low half first) as two floats.
template <typename T> __device__ __forceinline__ float2 pair_to_float2(uint32_t bits);
template <> __device__ __forceinline__ float2 pair_to_float2<half>(uint32_t bits) {
    __half2 h;
    memcpy(&h, &bits, sizeof(h));
    return __half22float2(h);
}
template <> __device__ __forceinline__ float2 pair_to_float2<__nv_bfloat16>(uint32_t bits) {
    return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xffff0000u));
}

// Two fp32 values rounded to nearest in T and packed as one 32-bit mma operand register (`lo` in the
// low half, the lower column).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    static_assert(std::is_same_v<T, half> || std::is_same_v<T, __nv_bfloat16>, "fp16 or bf16 pairs");
    uint32_t bits;
    if constexpr (std::is_same_v<T, half>) {
        const __half2 pair = __floats2half2_rn(lo, hi);
        memcpy(&bits, &pair, sizeof(bits));
    } else {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
        memcpy(&bits, &pair, sizeof(bits));
    }
    return bits;
}

// The packed pair type of T (two values in 32 bits) for the *2 intrinsics.
template <typename T> struct PairOf;
template <> struct PairOf<half> { using type = __half2; };
template <> struct PairOf<__nv_bfloat16> { using type = __nv_bfloat162; };

// Elementwise product of two 16-bit pairs, rounded to T.
template <typename T>
__device__ __forceinline__ uint32_t multiply_pairs(uint32_t a, uint32_t b) {
    using Pair = typename PairOf<T>::type;
    Pair x, y;
    memcpy(&x, &a, sizeof(x));
    memcpy(&y, &b, sizeof(y));
    const Pair product = __hmul2(x, y);
    uint32_t bits;
    memcpy(&bits, &product, sizeof(bits));
    return bits;
}

// c += A B on the tensor cores (mma.sync m16n8k16, sm_80+): A is 16x16 in the row-major fragment
// layout (4 registers), B 16x8 column-major (2 registers), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    static_assert(std::is_same_v<T, half> || std::is_same_v<T, __nv_bfloat16>, "fp16 or bf16 operands");
    if constexpr (std::is_same_v<T, half>)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The RMSNorm scale rsqrt(mean(x^2) + eps) of column `token` of the warps' partial sums of squares.
template <int kWarps, int kCols>
__device__ __forceinline__ float rms_scale(const float (&sum_sq_part)[kWarps][kCols], int token, int k, float eps) {
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) total += sum_sq_part[i][token];
    return rsqrtf(total / k + eps);
}

// silu(gate) * up: the MLP's activation, fused into the epilogues of its [gate; up] projection.
__device__ __forceinline__ float silu_times(float gate, float up) { return gate / (1.0f + __expf(-gate)) * up; }

// The end of a scalar decode projection (one warp per output row; each lane holds fp32 partial sums per token):
// the warp's sums reduced and lane 0 writing each token's output, with the fusions of launch.h (`norm`: sum_sq
// holds the squares of x, the RMS scale multiplies the sums; `silu_mul`: up_acc holds the up row's sums).
template <typename T, int kMaxTokens>
__device__ __forceinline__ void store_scalar_projection(const float (&acc)[kMaxTokens],
                                                        const float (&up_acc)[kMaxTokens],
                                                        const float (&sum_sq)[kMaxTokens], T* out, int tokens,
                                                        int outputs, int row, int k, float eps, bool norm,
                                                        bool accumulate, bool silu_mul) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int tok = 0; tok < kMaxTokens; ++tok) {
        if (tok >= tokens) break;
        const float scale = norm ? rsqrtf(warp_sum(sum_sq[tok]) / k + eps) : 1.0f;
        const float sum = warp_sum(acc[tok]) * scale;
        const float up = silu_mul ? warp_sum(up_acc[tok]) * scale : 0.0f;
        const int64_t idx = (int64_t)tok * outputs + row;
        if (lane != 0) continue;
        if (silu_mul) out[idx] = from_float<T>(silu_times(sum, up));
        else out[idx] = from_float<T>(sum + (accumulate ? to_float(out[idx]) : 0.0f));
    }
}

// ---- sm_80+ asynchronous copies into shared memory and shared-memory matrix loads ----

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1; when !valid nothing is read and zeros are written.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid = true) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// ldmatrix_x4 with each 8x8 matrix transposed (the B operand of P V read from row-major V).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// Streaming 16-byte load that does not allocate in L1: weights are read exactly once per token.
__device__ __forceinline__ uint4 load_stream_16B(const void* ptr) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(ptr));
    return r;
}

// Programmatic dependent launch (sm_90+; no-ops before): a kernel whose weights never depend on the
// previous kernel lets its successor launch early and waits only before it reads activations. Reads
// after the wait must be coherent loads: ptxas may hoist read-only `.nc` loads above griddepcontrol.wait.
__device__ __forceinline__ void allow_dependents_to_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Coherent 16-byte load for data the previous kernel may have written (see above: not `.nc`).
__device__ __forceinline__ uint4 load_coherent_16B(const void* ptr) {
    uint4 r;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(ptr)
                 : "memory");
    return r;
}

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

inline bool device_supports_pdl() {
    int device = 0, major = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    return major >= 9;
}

// Launches `kernel` as a programmatic dependent of the previous kernel in the stream (sm_90+), so it
// is resident and waiting in griddepcontrol.wait while that kernel drains. Every kernel launched
// this way calls wait_for_previous_kernel() in all blocks before it reads anything an earlier kernel
// wrote: the completion of each kernel then implies the completion of all before it.
template <typename... Params, typename... Args>
cudaError_t launch_with_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                            cudaStream_t stream, bool pdl, Args... args) {
    cudaLaunchAttribute attribute;
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem_bytes;
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = pdl && device_supports_pdl() ? 1 : 0;
    return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

}  // namespace minfer
