#include "rms_norm.h"
#include "common/device_utils.cuh"

#include <algorithm>

namespace minfer {

namespace {

constexpr int kMaxThreads = 512;

// Packs each thread holds (with the residual's, within 128 registers).
constexpr int packs_per_thread(int vec) { return vec == 1 ? 16 : 4; }

// VEC elements loaded and stored as one access (16 bytes when VEC * sizeof(T) == 16).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
    T v[VEC];
};

// Sum over the whole block; every thread gets the result.
__device__ float block_sum(float v) {
    __shared__ float warp_totals[32];
    __shared__ float total;
    v = warp_sum(v);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warp_totals[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (int)(blockDim.x / 32) ? warp_totals[lane] : 0.0f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

// One block per row; the row stays in registers between the reduction and the write, so each
// byte is read once. `out` may alias `x` (in-place norm): every element is read and written by
// the same thread.
template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_kernel(const T* x, T* __restrict__ residual, const T* __restrict__ weight, T* out,
                                int64_t hidden, float eps) {
    using P = Pack<T, VEC>;
    constexpr int kPacks = packs_per_thread(VEC);
    allow_dependents_to_launch();
    const int packs = (int)(hidden / VEC);
    const int64_t row_offset = blockIdx.x * hidden;
    const P* x_row = reinterpret_cast<const P*>(x + row_offset);
    P* res_row = reinterpret_cast<P*>(residual + row_offset);

    // The weight is no activation: load it before the PDL wait, so that after the reduction nothing
    // waits for memory again.
    const P* w = reinterpret_cast<const P*>(weight);
    P wv[kPacks];
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < packs) wv[k] = w[i];
    }
    wait_for_previous_kernel();

    // Issue every load before the first use so they are in flight together.
    P vals[kPacks], res[kPacks];
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < packs) {
            vals[k] = x_row[i];
            if (residual != nullptr) res[k] = res_row[i];
        }
    }

    float sum_sq = 0.0f;
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < packs) {
            if (residual != nullptr) {  // the sum is rounded to T, as `residual + x` is in the model
#pragma unroll
                for (int j = 0; j < VEC; ++j)
                    vals[k].v[j] = from_float<T>(to_float(vals[k].v[j]) + to_float(res[k].v[j]));
                res_row[i] = vals[k];
            }
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const float f = to_float(vals[k].v[j]);
                sum_sq += f * f;
            }
        }
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq) / (float)hidden + eps);

    P* out_row = reinterpret_cast<P*>(out + row_offset);
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < packs) {
            const P wk = wv[k];
            P o;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {  // HF: weight * normed.to(input dtype)
                const T normed = from_float<T>(to_float(vals[k].v[j]) * inv_rms);
                o.v[j] = from_float<T>(to_float(wk.v[j]) * to_float(normed));
            }
            out_row[i] = o;
        }
    }
}

bool aligned_16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
bool launch_typed(const void* x, void* residual, const void* weight, void* out, int64_t rows, int64_t hidden,
                  float eps, cudaStream_t stream) {
    constexpr int kVec = 16 / sizeof(T);
    const bool vectorised = hidden % kVec == 0 && aligned_16(x) && aligned_16(residual) && aligned_16(weight) &&
                            aligned_16(out);
    const int64_t packs = vectorised ? hidden / kVec : hidden;
    if (packs > (int64_t)kMaxThreads * packs_per_thread(vectorised ? kVec : 1)) return false;
    const int threads = (int)std::min<int64_t>(kMaxThreads, (packs + 31) / 32 * 32);
    const auto* xt = static_cast<const T*>(x);
    auto* rt = static_cast<T*>(residual);
    const auto* wt = static_cast<const T*>(weight);
    auto* ot = static_cast<T*>(out);
    auto kernel = vectorised ? rms_norm_kernel<T, kVec> : rms_norm_kernel<T, 1>;
    launch_with_pdl(kernel, dim3((unsigned)rows), dim3(threads), 0, stream, true, xt, rt, wt, ot, hidden, eps);
    return true;
}

}  // namespace

bool launch_rms_norm(const void* x, void* residual, const void* weight, void* out, int64_t rows, int64_t hidden,
                     float eps, DType dtype, cudaStream_t stream) {
    if (rows == 0) return true;
    switch (dtype) {
        case DType::kFloat16: return launch_typed<half>(x, residual, weight, out, rows, hidden, eps, stream);
        case DType::kBFloat16:
            return launch_typed<__nv_bfloat16>(x, residual, weight, out, rows, hidden, eps, stream);
        case DType::kFloat32: return launch_typed<float>(x, residual, weight, out, rows, hidden, eps, stream);
    }
    return false;
}

}  // namespace minfer
