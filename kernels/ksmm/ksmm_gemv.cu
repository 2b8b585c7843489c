// The KS factor kernel "gemv" (ksmm_kernels.cuh): the bandwidth path on the tensor cores, up to 16 tokens.
#include <cooperative_groups.h>

#include <algorithm>

#include "ksmm/ksmm.h"
#include "ksmm/ksmm_kernels.cuh"

namespace minfer::ksmm_detail {

namespace {

constexpr int kGemvMaxWarps = 8;
constexpr int kGemvMaxSplits = 8;  // blocks of one tile: a portable cluster
constexpr int kGemvChunks = 4;  // 16-byte chunks of each of its rows a lane loads per step

// 16 bits of a 16-byte chunk: element e.
__device__ __forceinline__ uint32_t chunk_word(const uint4& chunk, int word) {
    return word == 0 ? chunk.x : word == 1 ? chunk.y : word == 2 ? chunk.z : chunk.w;
}

// Values v and v + 1 of plane l among a lane's kGemvChunks chunks, packed low first: value v is element
// (v % (8 / DL)) * DL + l of chunk v / (8 / DL), i.e. the lane's k's of that l in order. Every index is a
// compile-time constant once the callers' loops are unrolled, so this is one PRMT.
template <int DL>
__device__ __forceinline__ uint32_t pack_plane_pair(const uint4 (&chunks)[kGemvChunks], int l, int v) {
    constexpr int per_chunk = 8 / DL;
    const int e0 = v % per_chunk * DL + l, e1 = (v + 1) % per_chunk * DL + l;
    const uint32_t lo = chunk_word(chunks[v / per_chunk], e0 / 2), hi = chunk_word(chunks[(v + 1) / per_chunk], e1 / 2);
    return __byte_perm(lo, hi, (e0 % 2 ? 0x32u : 0x10u) | (e1 % 2 ? 0x7600u : 0x5400u));
}

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

// A cluster of `splits` blocks per tile: 16 rows j of one i (and, for d > 8, one group of 8 l's); the
// cluster's warps split the row into steps of 16 chunks per row (few tiles then still fill the GPU). Lane
// (g, t) loads chunks step * 16 + 4 q + t (q < 4) of rows j0 + g and j0 + g + 8 and of x for token g (and
// g + 8), so each load instruction reads 64 contiguous bytes per row.
// A chunk holds 8 / DL k's times DL l's (d <= 8: the row's elements u * 8 ..; d > 8: k = u, l's 8 G ..).
// Per l, a lane's 32 / DL values of that l feed 8 / DL mma.m16n8k16 (A: the 16 rows, B: the tokens) in a
// k-slot order that depends on t alone, the same for A and B, so each dot product is exact in any order.
// The warps' fp32 sums meet in shared memory; the cluster's first block adds them in block then warp order
// (deterministic), reading the others' through distributed shared memory. Launched as a programmatic
// dependent (PDL): the first weights are on the way before the previous kernel ends; x waits for it.
// Decode fusions (launch.h, ProjectionFusion): a norm weight g multiplies x's chunks as they load and the
// cluster's first block scales its sums by each token's rsqrt(mean(x^2) + eps) over the whole x row (read
// from L2 while the other blocks finish); accumulate adds y's old value; silu_mul (a == 1, b even: the MLP's
// [gate; up] rows j and j + b/2) gives a tile 8 gate rows as its rows g and their up rows as rows g + 8, so
// the lane holding a gate sum holds its up sum and writes silu(gate) * up into y [tokens][b/2 * d].
template <typename T, int DL, int NT>
__global__ void __launch_bounds__(kGemvMaxWarps * 32) ksmm_gemv_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                                      T* __restrict__ y, int tokens, int a, int b,
                                                                      int c, int d, int splits,
                                                                      const T* __restrict__ norm_weight, float eps,
                                                                      bool accumulate, bool silu_mul) {
    constexpr int kAcc = DL * NT * 4;
    constexpr int kSteps = NT == 1 ? 2 : 1;  // steps in flight per warp
    extern __shared__ float partial[];       // [warps][kAcc][32]
    const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int groups = DL == 8 ? d / 8 : 1;
    const int tile_rows = silu_mul ? 8 : 16, row_end = silu_mul ? b / 2 : b, hi_offset = silu_mul ? b / 2 : 8;
    const int j_tiles = (row_end + tile_rows - 1) / tile_rows;
    const int split = blockIdx.x % splits, tile = blockIdx.x / splits;
    const int group = tile % groups, j0 = tile / groups % j_tiles * tile_rows, i = tile / groups / j_tiles;
    const int cluster_warps = splits * warps;
    const int64_t row_len = (int64_t)c * d, l0 = DL == 8 ? 8 * group : 0;
    const int units = DL == 8 ? c : (int)(row_len / 8);  // chunks along the row (of this l group)
    const int steps = (units + 15) / 16;
    // Rows past b and tokens past the batch load row / token 0 and drop it (loads without branches stay in
    // flight together).
    const bool lo_ok = j0 + g < row_end, hi_ok = j0 + g + hi_offset < b, x_lo_ok = g < tokens, x_hi_ok = g + 8 < tokens;
    const T* w_lo = w + ((int64_t)i * b + (lo_ok ? j0 + g : 0)) * row_len + l0;
    const T* w_hi = w + ((int64_t)i * b + (hi_ok ? j0 + g + hi_offset : 0)) * row_len + l0;
    const T* g_row = norm_weight ? norm_weight + (int64_t)i * row_len + l0 : nullptr;  // g has x's row layout
    const T* x_lo = x + ((int64_t)(x_lo_ok ? g : 0) * a + i) * row_len + l0;
    const T* x_hi = x + ((int64_t)(x_hi_ok ? g + 8 : 0) * a + i) * row_len + l0;
    const auto offset = [&](int u) { return DL == 8 ? (int64_t)u * d : (int64_t)u * 8; };
    const auto keep = [](bool ok, const uint4& v) { return ok ? v : make_uint4(0, 0, 0, 0); };

    allow_dependents_to_launch();
    float acc[DL][NT][4] = {};
    bool waited = false;
    for (int first = split * warps + warp; first < steps; first += cluster_warps * kSteps) {
        uint4 wl[kSteps][kGemvChunks], wh[kSteps][kGemvChunks], xl[kSteps][kGemvChunks];
        uint4 xh[NT == 2 ? kSteps : 1][kGemvChunks];
        bool valid[kSteps][kGemvChunks];  // the chunk lies on the row (else chunk 0 is loaded and dropped)
        int at[kSteps][kGemvChunks];      // its offset along the row (c*d fits int32: the binding checks)
#pragma unroll
        for (int s = 0; s < kSteps; ++s)
#pragma unroll
            for (int q = 0; q < kGemvChunks; ++q) {
                const int step = first + s * cluster_warps, u = step * 16 + q * 4 + t;
                valid[s][q] = step < steps && u < units;
                at[s][q] = valid[s][q] ? (int)offset(u) : 0;
                wl[s][q] = keep(valid[s][q] && lo_ok, load_stream_16B(w_lo + at[s][q]));
                wh[s][q] = keep(valid[s][q] && hi_ok, load_stream_16B(w_hi + at[s][q]));
            }
        if (!waited) {
            wait_for_previous_kernel();  // x may come from it: coherent loads from here on
            waited = true;
        }
#pragma unroll
        for (int s = 0; s < kSteps; ++s)
#pragma unroll
            for (int q = 0; q < kGemvChunks; ++q) {
                xl[s][q] = keep(valid[s][q] && x_lo_ok, load_coherent_16B(x_lo + at[s][q]));
                if constexpr (NT == 2) xh[s][q] = keep(valid[s][q] && x_hi_ok, load_coherent_16B(x_hi + at[s][q]));
                if (norm_weight) {
                    const uint4 gv = load_stream_16B(g_row + at[s][q]);
                    xl[s][q] = scale_chunk<T>(xl[s][q], gv);
                    if constexpr (NT == 2) xh[s][q] = scale_chunk<T>(xh[s][q], gv);
                }
            }
#pragma unroll
        for (int s = 0; s < kSteps; ++s)
#pragma unroll
            for (int l = 0; l < DL; ++l)
#pragma unroll
                for (int m = 0; m < 8 / DL; ++m) {
                    const uint32_t af[4] = {pack_plane_pair<DL>(wl[s], l, 4 * m), pack_plane_pair<DL>(wh[s], l, 4 * m),
                                            pack_plane_pair<DL>(wl[s], l, 4 * m + 2),
                                            pack_plane_pair<DL>(wh[s], l, 4 * m + 2)};
                    mma_m16n8k16<T>(acc[l][0], af, pack_plane_pair<DL>(xl[s], l, 4 * m),
                                    pack_plane_pair<DL>(xl[s], l, 4 * m + 2));
                    if constexpr (NT == 2)
                        mma_m16n8k16<T>(acc[l][NT - 1], af, pack_plane_pair<DL>(xh[s], l, 4 * m),
                                        pack_plane_pair<DL>(xh[s], l, 4 * m + 2));
                }
    }
#pragma unroll
    for (int l = 0; l < DL; ++l)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) partial[(warp * kAcc + (l * NT + nt) * 4 + r) * 32 + lane] = acc[l][nt][r];
    wait_for_previous_kernel();  // y too may be read by it (warps without steps never waited above)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    const bool first_block = cluster.block_rank() == 0;
    const auto sums_of = [&](int rank) { return cluster.map_shared_rank(partial, rank); };
#else
    const bool first_block = true;  // no clusters before sm_90: the launcher keeps splits at 1
    const auto sums_of = [&](int) { return partial; };
#endif
    __shared__ float token_scale[8 * NT];  // norm_weight: each token's rsqrt(mean(x^2) + eps)
    if (norm_weight && first_block) {
        __shared__ float warp_sum_sq[kGemvMaxWarps][8 * NT];
        const int64_t x_len = (int64_t)a * row_len, x_chunks = x_len / 8;
        float sum_sq[8 * NT] = {};
        for (int64_t e = threadIdx.x; e < x_chunks; e += blockDim.x)
#pragma unroll
            for (int n = 0; n < 8 * NT; ++n)
                if (n < tokens) sum_sq[n] = chunk_sum_sq<T>(load_coherent_16B(x + n * x_len + 8 * e), sum_sq[n]);
#pragma unroll
        for (int n = 0; n < 8 * NT; ++n) {
            const float total = warp_sum(sum_sq[n]);
            if (lane == 0) warp_sum_sq[warp][n] = total;
        }
        __syncthreads();
        if (threadIdx.x < tokens) {
            float total = 0.f;
            for (int k = 0; k < warps; ++k) total += warp_sum_sq[k][threadIdx.x];
            token_scale[threadIdx.x] = rsqrtf(total / (float)x_len + eps);
        }
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cluster.sync();
#else
    __syncthreads();
#endif
    // C fragment: c0, c1 = row g, tokens 2t, 2t + 1 of the n-tile; c2, c3 = row g + 8 (silu_mul: g's up row).
    const auto sum_of = [&](int idx, int owner) {
        float sum = 0.f;
        for (int rank = 0; rank < splits; ++rank) {
            const float* sums = sums_of(rank);
            for (int k = 0; k < warps; ++k) sum += sums[(k * kAcc + idx) * 32 + owner];
        }
        return sum;
    };
    if (first_block)
        for (int e = threadIdx.x; e < kAcc * 32; e += blockDim.x) {
            const int idx = e / 32, owner = e % 32, r = idx % 4, nt = idx / 4 % NT, l = idx / (4 * NT);
            if (silu_mul && r >= 2) continue;
            const int j = j0 + owner / 4 + (r >= 2 ? 8 : 0), n = nt * 8 + 2 * (owner % 4) + (r & 1);
            if (j >= row_end || n >= tokens) continue;
            const float scale = norm_weight ? token_scale[n] : 1.f;
            float value = sum_of(idx, owner) * scale;
            const int64_t at = (((int64_t)n * a + i) * row_end + j) * d + l0 + l;
            if (silu_mul) value = silu_times(value, sum_of(idx + 2, owner) * scale);
            else if (accumulate) value += to_float(y[at]);
            y[at] = from_float<T>(value);
        }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cluster.sync();  // the other blocks' shared memory stays until the first block has read it
#endif
}

template <typename T, int DL, int NT>
void launch_gemv_tile(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                      const ProjectionFusion& fusion, cudaStream_t stream) {
    const auto kernel = ksmm_gemv_kernel<T, DL, NT>;
    constexpr int kMaxSmem = kGemvMaxWarps * DL * NT * 4 * 32 * (int)sizeof(float);
    static const cudaError_t configured =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem);
    (void)configured;
    const int64_t units = DL == 8 ? c : c * d / 8, steps = (units + 15) / 16;
    const int warps = (int)std::min<int64_t>(kGemvMaxWarps, steps);
    const int64_t tiles = a * (fusion.silu_mul ? (b / 2 + 7) / 8 : (b + 15) / 16) * (DL == 8 ? d / 8 : 1);
    // Blocks per tile (sm_90+, a cluster): enough for two blocks per SM, each warp keeping at least one step.
    const bool hopper = device_supports_pdl();  // clusters and PDL both start at sm_90
    const int64_t wanted = (2 * sm_count() + tiles - 1) / tiles, useful = (steps + warps - 1) / warps;
    const int splits = hopper ? (int)std::max<int64_t>(1, std::min<int64_t>({kGemvMaxSplits, wanted, useful})) : 1;
    cudaLaunchAttribute attributes[2];
    attributes[0].id = cudaLaunchAttributeClusterDimension;
    attributes[0].val.clusterDim.x = splits;
    attributes[0].val.clusterDim.y = 1;
    attributes[0].val.clusterDim.z = 1;
    attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[1].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3((unsigned)(tiles * splits));
    config.blockDim = dim3(warps * 32);
    config.dynamicSmemBytes = warps * DL * NT * 4 * 32 * sizeof(float);
    config.stream = stream;
    config.attrs = attributes;
    config.numAttrs = hopper ? 2 : 0;
    cudaLaunchKernelEx(&config, kernel, x, w, y, (int)tokens, (int)a, (int)b, (int)c, (int)d, splits,
                       static_cast<const T*>(fusion.norm_weight), fusion.eps, fusion.accumulate, fusion.silu_mul);
}

template <typename T, int DL>
void launch_gemv_for(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                     const ProjectionFusion& fusion, cudaStream_t stream) {
    if (tokens <= 8)
        launch_gemv_tile<T, DL, 1>(x, w, y, tokens, a, b, c, d, fusion, stream);
    else
        launch_gemv_tile<T, DL, 2>(x, w, y, tokens, a, b, c, d, fusion, stream);
}

}  // namespace

template <typename T>
void launch_gemv(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                 const ProjectionFusion& fusion, cudaStream_t stream) {
    switch (d < 8 ? d : 8) {
        case 1: return launch_gemv_for<T, 1>(x, w, y, tokens, a, b, c, d, fusion, stream);
        case 2: return launch_gemv_for<T, 2>(x, w, y, tokens, a, b, c, d, fusion, stream);
        case 4: return launch_gemv_for<T, 4>(x, w, y, tokens, a, b, c, d, fusion, stream);
        default: return launch_gemv_for<T, 8>(x, w, y, tokens, a, b, c, d, fusion, stream);
    }
}

template void launch_gemv<half>(const half*, const half*, half*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                const ProjectionFusion&, cudaStream_t);
template void launch_gemv<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*, int64_t, int64_t,
                                         int64_t, int64_t, int64_t, const ProjectionFusion&, cudaStream_t);

}  // namespace minfer::ksmm_detail
