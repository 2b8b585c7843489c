// The KS factor kernel "rows" (ksmm_kernels.cuh): the bandwidth path on CUDA cores. A group of threads per
// output row (i, j) streams W[i][j][:][:] (c*d contiguous values) once in 16-byte vectors against x[n][i][:][:]
// (contiguous too). Element p of the run belongs to l = p mod d; with d a power of two dividing 8 * group, a
// thread always meets the same l's, so it keeps 8 fp32 sums per token and the group reduces them by shuffles
// (and shared memory past one warp). A decode projection's fusions at one token (launch.h, ProjectionFusion):
// `accumulate` adds into y (the residual); a norm weight g scales x's vectors as they load and the block's
// pass over the whole x row (from L2, after the sums) gives rsqrt(mean(x^2) + eps); silu_mul (a == 1, b even)
// gives a group rows j and j + b/2, the MLP's gate and up, and writes silu(gate) * up into y [b/2 * d].
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

// kSums sets of 8 sums a thread: one per token, or with SILU (one token) the gate row's and the up row's.
template <typename T, int TOKENS, bool SILU>
__global__ void __launch_bounds__(kThreads) ksmm_rows_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                            T* __restrict__ y, int tokens, int a, int b, int c,
                                                            int d, int group, const T* __restrict__ norm_weight,
                                                            float eps, bool accumulate) {
    static_assert(!SILU || TOKENS == 1, "silu_mul runs one token");
    constexpr int kRows = SILU ? 2 : 1, kSums = SILU ? 2 : TOKENS;
    __shared__ float partial[kThreads / 32][kSums][kKsmmRowsMaxD];
    const int64_t row_len = (int64_t)c * d, rows = SILU ? b / 2 : (int64_t)a * b;
    const int vectors = (int)(row_len / 8);
    const int t = threadIdx.x % group;
    const int64_t row = (int64_t)blockIdx.x * (kThreads / group) + threadIdx.x / group;
    float acc[kSums][8] = {};
    const uint4* w_rows[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) w_rows[r] = reinterpret_cast<const uint4*>(w + (row + r * rows) * row_len);
    uint4 wv[kRows][kRowsUnroll];
    auto load_round = [&](int first) {
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int u = 0; u < kRowsUnroll; ++u) {
                const int v = first + u * group;
                wv[r][u] = v < vectors ? load_stream_16B(w_rows[r] + v) : make_uint4(0, 0, 0, 0);
            }
    };
    // The first round of weights streams in while the previous kernel drains (programmatic dependent
    // launch); x, which that kernel writes, is read only after the wait, with coherent loads.
    if (row < rows) load_round(t);
    wait_for_previous_kernel();
    allow_dependents_to_launch();
    // The norm (one token): every thread of the block sums squares over the whole x row (its loads in flight
    // with the row's first ones), reduced in a fixed order after the sums.
    float sum_sq = 0.f;
    const int64_t x_len = (int64_t)a * row_len;
    if (norm_weight)
        for (int64_t e = threadIdx.x; e < x_len / 8; e += kThreads)
            sum_sq = chunk_sum_sq<T>(load_coherent_16B(x + 8 * e), sum_sq);
    if (row < rows) {
        const int64_t x_offset = SILU ? 0 : row / b * row_len;
        const uint4* x_row = reinterpret_cast<const uint4*>(x + x_offset);
        const uint4* g_row = norm_weight ? reinterpret_cast<const uint4*>(norm_weight + x_offset) : nullptr;
        const int64_t token_stride = (int64_t)a * vectors;  // in vectors
        for (int first = t; first < vectors; first += kRowsUnroll * group) {
            if (first != t) load_round(first);
#pragma unroll
            for (int u = 0; u < kRowsUnroll; ++u) {
                const int v = first + u * group;
                if (v < vectors) {
                    const uint4 g = norm_weight ? load_stream_16B(g_row + v) : make_uint4(0, 0, 0, 0);
#pragma unroll
                    for (int n = 0; n < TOKENS; ++n) {
                        if (TOKENS == 1 || n < tokens) {
                            uint4 xv = load_coherent_16B(x_row + n * token_stride + v);
                            if (norm_weight) xv = scale_chunk<T>(xv, g);
                            float xf[8];
                            unpack8<T>(xv, xf);
#pragma unroll
                            for (int r = 0; r < kRows; ++r) {
                                float wf[8];
                                unpack8<T>(wv[r][u], wf);
#pragma unroll
                                for (int e = 0; e < 8; ++e) {
                                    float& sum = acc[SILU ? r : n][e];
                                    sum = fmaf(wf[e], xf[e], sum);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    // Element e of a thread's vectors is l = (8 t + e) mod d: fold e onto e mod d when d < 8.
#pragma unroll
    for (int s = 0; s < kSums; ++s) {
#pragma unroll
        for (int half = 4; half >= 1; half >>= 1)
            if (d <= half)
#pragma unroll
                for (int e = 0; e < half; ++e) acc[s][e] += acc[s][e + half];
    }
    const int slots = d < 8 ? d : 8;
    const int owners = d < 8 ? 1 : d / 8;  // threads t and t' hold the same l's when t = t' mod owners
    const int width = group < 32 ? group : 32;
    for (int offset = width / 2; offset >= owners; offset >>= 1)
#pragma unroll
        for (int s = 0; s < kSums; ++s)
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (e < slots) acc[s][e] += __shfl_xor_sync(0xffffffffu, acc[s][e], offset);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float scale = 1.f;
    if (norm_weight) {
        __shared__ float warp_sum_sq[kThreads / 32];
        sum_sq = warp_sum(sum_sq);
        if (lane == 0) warp_sum_sq[warp] = sum_sq;
        __syncthreads();
        float total = 0.f;
#pragma unroll
        for (int k = 0; k < kThreads / 32; ++k) total += warp_sum_sq[k];
        scale = rsqrtf(total / (float)x_len + eps);
    }
    const int64_t out_stride = rows * d;  // y's token stride
    // Output l of row for token n (or, with SILU, the gate and up sums of one token) from its sums.
    const auto store = [&](int n, int l, float sum, float up) {
        T& out = y[n * out_stride + row * d + l];
        if (SILU) out = from_float<T>(silu_times(sum * scale, up * scale));
        else out = from_float<T>(accumulate ? sum * scale + to_float(out) : sum * scale);
    };
    if (group <= 32) {
        if (row < rows && t < owners)
#pragma unroll
            for (int n = 0; n < TOKENS; ++n)
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (e < slots && (TOKENS == 1 || n < tokens))
                        store(n, 8 * t + e, acc[SILU ? 0 : n][e], acc[kSums - 1][e]);
        return;
    }
    if (lane < owners)
#pragma unroll
        for (int s = 0; s < kSums; ++s)
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (e < slots) partial[warp][s][8 * lane + e] = acc[s][e];
    __syncthreads();
    const int first_warp = threadIdx.x / group * (group / 32);
    const auto group_sum = [&](int s, int l) {
        float sum = 0.f;
        for (int k = 0; k < group / 32; ++k) sum += partial[first_warp + k][s][l];  // fixed order
        return sum;
    };
    if (row < rows)
        for (int o = t; o < tokens * d; o += group) {
            const int n = o / d, l = o % d;
            store(n, l, group_sum(SILU ? 0 : n, l), SILU ? group_sum(1, l) : 0.f);
        }
}

// Threads per row: about one round of kRowsUnroll vectors each, at least enough to give every l an owner.
int rows_group(int64_t c, int64_t d) {
    const int64_t vectors = c * d / 8, owners = d < 8 ? 1 : d / 8;
    int group = 8;
    while (group < kThreads && (int64_t)group * kRowsUnroll < vectors) group *= 2;
    return (int)std::max<int64_t>(group, owners);
}

template <typename T, int TOKENS, bool SILU = false>
void launch_rows_for(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                     const ProjectionFusion& fusion, cudaStream_t stream) {
    const int group = rows_group(c, d);
    const int64_t rows_per_block = kThreads / group, rows = SILU ? b / 2 : a * b;
    const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
    launch_with_pdl(ksmm_rows_kernel<T, TOKENS, SILU>, dim3((unsigned)blocks), dim3(kThreads), 0, stream, true, x, w,
                    y, (int)tokens, (int)a, (int)b, (int)c, (int)d, group,
                    static_cast<const T*>(fusion.norm_weight), fusion.eps, fusion.accumulate);
}

}  // namespace

template <typename T>
void launch_rows(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                 const ProjectionFusion& fusion, cudaStream_t stream) {
    if (fusion.silu_mul) return launch_rows_for<T, 1, true>(x, w, y, tokens, a, b, c, d, fusion, stream);
    if (tokens <= 1) return launch_rows_for<T, 1>(x, w, y, tokens, a, b, c, d, fusion, stream);
    if (tokens <= 2) return launch_rows_for<T, 2>(x, w, y, tokens, a, b, c, d, fusion, stream);
    if (tokens <= 4) return launch_rows_for<T, 4>(x, w, y, tokens, a, b, c, d, fusion, stream);
    if (tokens <= 8) return launch_rows_for<T, 8>(x, w, y, tokens, a, b, c, d, fusion, stream);
    return launch_rows_for<T, 16>(x, w, y, tokens, a, b, c, d, fusion, stream);
}

template void launch_rows<half>(const half*, const half*, half*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                const ProjectionFusion&, cudaStream_t);
template void launch_rows<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*, int64_t, int64_t,
                                         int64_t, int64_t, int64_t, const ProjectionFusion&, cudaStream_t);

}  // namespace minfer::ksmm_detail
