// The KS factor kernels (ksmm.h), one file per kernel so that they compile in parallel: ksmm_rows.cu,
// ksmm_gemv.cu, ksmm_mma.cu; ksmm.cu holds the generic kernel and picks one. Each launcher takes x [tokens][a*c*d],
// the factor W [a][b][c][d] and y [tokens][a*b*d] (contiguous) and a shape its kernel supports (ksmm_path_supports).
#pragma once
#include "common/device_utils.cuh"

namespace minfer::ksmm_detail {

constexpr int kThreads = 256;

// The 8 values of a chunk times g's (the RMSNorm weight), rounded to T.
template <typename T>
__device__ __forceinline__ uint4 scale_chunk(const uint4& v, const uint4& g) {
    return make_uint4(multiply_pairs<T>(v.x, g.x), multiply_pairs<T>(v.y, g.y), multiply_pairs<T>(v.z, g.z),
                      multiply_pairs<T>(v.w, g.w));
}

template <typename T>
__device__ __forceinline__ float chunk_sum_sq(const uint4& v, float sum) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float2 f = pair_to_float2<T>(words[e]);
        sum = fmaf(f.x, f.x, fmaf(f.y, f.y, sum));
    }
    return sum;
}

int sm_count();

// rows and gemv also run the decode fusions (ksmm_gemv_fusion_supports says which shapes take which); rows
// only at one token.
template <typename T>
void launch_rows(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                 const ProjectionFusion& fusion, cudaStream_t stream);
template <typename T>
void launch_gemv(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                 const ProjectionFusion& fusion, cudaStream_t stream);
template <typename T>
void launch_mma(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                cudaStream_t stream);

}  // namespace minfer::ksmm_detail
