// The KS factor kernel "rows" (ksmm_kernels.cuh): the bandwidth path on CUDA cores. A group of threads per
// output row (i, j) streams W[i][j][:][:] (c*d contiguous values) once in 16-byte vectors against x[n][i][:][:]
// (contiguous too). Element p of the run belongs to l = p mod d; with d a power of two dividing 8 * group, a
// thread always meets the same l's, so it keeps 8 fp32 sums per token and the group reduces them by shuffles
// (and shared memory past one warp). With `accumulate` it adds into y (a decode projection's residual).
#include "ksmm/ksmm.h"
#include "ksmm/ksmm_kernels.cuh"

namespace minfer::ksmm_detail {

namespace {

constexpr int kRowsUnroll = 4;  // 16-byte weight vectors per thread in flight

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const float2 pair = pair_to_float2<T>(words[q]);
        f[2 * q] = pair.x;
        f[2 * q + 1] = pair.y;
    }
}

template <typename T, int TOKENS>
__global__ void __launch_bounds__(kThreads) ksmm_rows_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                            T* __restrict__ y, int tokens, int a, int b, int c,
                                                            int d, int group, bool accumulate) {
    __shared__ float partial[kThreads / 32][TOKENS][kKsmmRowsMaxD];
    const int64_t row_len = (int64_t)c * d, rows = (int64_t)a * b;
    const int vectors = (int)(row_len / 8);
    const int t = threadIdx.x % group;
    const int64_t row = (int64_t)blockIdx.x * (kThreads / group) + threadIdx.x / group;
    float acc[TOKENS][8] = {};
    const uint4* w_row = reinterpret_cast<const uint4*>(w + row * row_len);
    uint4 wv[kRowsUnroll];
    auto load_round = [&](int first) {
#pragma unroll
        for (int u = 0; u < kRowsUnroll; ++u) {
            const int v = first + u * group;
            wv[u] = v < vectors ? load_stream_16B(w_row + v) : make_uint4(0, 0, 0, 0);
        }
    };
    // The first round of weights streams in while the previous kernel drains (programmatic dependent
    // launch); x, which that kernel writes, is read only after the wait, with coherent loads.
    if (row < rows) load_round(t);
    wait_for_previous_kernel();
    allow_dependents_to_launch();
    if (row < rows) {
        const uint4* x_row = reinterpret_cast<const uint4*>(x + row / b * row_len);
        const int64_t token_stride = (int64_t)a * vectors;  // in vectors
        for (int first = t; first < vectors; first += kRowsUnroll * group) {
            if (first != t) load_round(first);
#pragma unroll
            for (int u = 0; u < kRowsUnroll; ++u) {
                const int v = first + u * group;
                if (v < vectors) {
                    float wf[8];
                    unpack8<T>(wv[u], wf);
#pragma unroll
                    for (int n = 0; n < TOKENS; ++n) {
                        if (TOKENS == 1 || n < tokens) {
                            float xf[8];
                            unpack8<T>(load_coherent_16B(x_row + n * token_stride + v), xf);
#pragma unroll
                            for (int e = 0; e < 8; ++e) acc[n][e] = fmaf(wf[e], xf[e], acc[n][e]);
                        }
                    }
                }
            }
        }
    }
    // Element e of a thread's vectors is l = (8 t + e) mod d: fold e onto e mod d when d < 8.
#pragma unroll
    for (int n = 0; n < TOKENS; ++n) {
#pragma unroll
        for (int half = 4; half >= 1; half >>= 1)
            if (d <= half)
#pragma unroll
                for (int e = 0; e < half; ++e) acc[n][e] += acc[n][e + half];
    }
    const int slots = d < 8 ? d : 8;
    const int owners = d < 8 ? 1 : d / 8;  // threads t and t' hold the same l's when t = t' mod owners
    const int width = group < 32 ? group : 32;
    for (int offset = width / 2; offset >= owners; offset >>= 1)
#pragma unroll
        for (int n = 0; n < TOKENS; ++n)
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (e < slots) acc[n][e] += __shfl_xor_sync(0xffffffffu, acc[n][e], offset);
    const int64_t out_stride = rows * d;  // y's token stride
    if (group <= 32) {
        if (row < rows && t < owners)
#pragma unroll
            for (int n = 0; n < TOKENS; ++n)
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (e < slots && (TOKENS == 1 || n < tokens)) {
                        T& out = y[n * out_stride + row * d + 8 * t + e];
                        out = from_float<T>(accumulate ? acc[n][e] + to_float(out) : acc[n][e]);
                    }
        return;
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane < owners)
#pragma unroll
        for (int n = 0; n < TOKENS; ++n)
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (e < slots) partial[warp][n][8 * lane + e] = acc[n][e];
    __syncthreads();
    const int first_warp = threadIdx.x / group * (group / 32);
    if (row < rows)
        for (int o = t; o < tokens * d; o += group) {
            const int n = o / d, l = o % d;
            float sum = 0.f;
            for (int k = 0; k < group / 32; ++k) sum += partial[first_warp + k][n][l];  // fixed order
            T& out = y[n * out_stride + row * d + l];
            out = from_float<T>(accumulate ? sum + to_float(out) : sum);
        }
}

// Threads per row: about one round of kRowsUnroll vectors each, at least enough to give every l an owner.
int rows_group(int64_t c, int64_t d) {
    const int64_t vectors = c * d / 8, owners = d < 8 ? 1 : d / 8;
    int group = 8;
    while (group < kThreads && (int64_t)group * kRowsUnroll < vectors) group *= 2;
    return (int)std::max<int64_t>(group, owners);
}

template <typename T, int TOKENS>
void launch_rows_for(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                     bool accumulate, cudaStream_t stream) {
    const int group = rows_group(c, d);
    const int64_t rows_per_block = kThreads / group;
    const int64_t blocks = (a * b + rows_per_block - 1) / rows_per_block;
    launch_with_pdl(ksmm_rows_kernel<T, TOKENS>, dim3((unsigned)blocks), dim3(kThreads), 0, stream, true, x, w, y,
                    (int)tokens, (int)a, (int)b, (int)c, (int)d, group, accumulate);
}

}  // namespace

template <typename T>
void launch_rows(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                 bool accumulate, cudaStream_t stream) {
    if (tokens <= 1) return launch_rows_for<T, 1>(x, w, y, tokens, a, b, c, d, accumulate, stream);
    if (tokens <= 2) return launch_rows_for<T, 2>(x, w, y, tokens, a, b, c, d, accumulate, stream);
    if (tokens <= 4) return launch_rows_for<T, 4>(x, w, y, tokens, a, b, c, d, accumulate, stream);
    if (tokens <= 8) return launch_rows_for<T, 8>(x, w, y, tokens, a, b, c, d, accumulate, stream);
    return launch_rows_for<T, 16>(x, w, y, tokens, a, b, c, d, accumulate, stream);
}

template void launch_rows<half>(const half*, const half*, half*, int64_t, int64_t, int64_t, int64_t, int64_t, bool,
                                cudaStream_t);
template void launch_rows<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*, int64_t, int64_t,
                                         int64_t, int64_t, int64_t, bool, cudaStream_t);

}  // namespace minfer::ksmm_detail
