// Tensor-core pieces shared by the two decode GEMV kernels (gemv.cu: weights streamed through
// registers, sm_80+; gemv_bulk.cu: weights streamed into shared memory by bulk copies, sm_90).
// A warp step multiplies a 16-row x 32-k tile of W by up to 8 tokens with two mma.m16n8k16 (the
// tokens are the n = 8 side). Lane (g, t) holds one 16-byte chunk of W row g and of row g + 8, and
// the chunk at the same k of token g's x. A dot product may sum k in any order, so the chunk's 8
// elements go to the k slots the fragment layout gives this lane: pairs {0,1},{2,3} are slots
// (2t, 2t+1), (2t+8, 2t+9) of the first k16 mma, pairs {4,5},{6,7} the same slots of the second.
// A and B get the same permutation, so the product is exact.
#pragma once
#include "device_utils.cuh"

namespace minfer {

constexpr int kGemvTileRows = 16;  // mma M
constexpr int kGemvChunk = 8;      // elements in one 16-byte load

// acc[0] and acc[1] are separate accumulators, so consecutive mmas do not wait on each other.
template <typename T>
__device__ __forceinline__ void multiply_chunk(float (&acc)[2][4], const uint4& lo, const uint4& hi, const uint4& xv) {
    const uint32_t first[4] = {lo.x, hi.x, lo.y, hi.y};
    const uint32_t second[4] = {lo.z, hi.z, lo.w, hi.w};
    mma_m16n8k16<T>(acc[0], first, xv.x, xv.y);
    mma_m16n8k16<T>(acc[1], second, xv.z, xv.w);
}

// RMSNorm fusion: adds the squares of the chunk's x to `sum_sq`, then x *= g (rounded to T: it
// feeds the tensor cores).
template <typename T>
__device__ __forceinline__ void scale_chunk_by_norm(uint4& xv, const uint4& g, float& sum_sq) {
    auto scale_pair = [&](uint32_t& xw, uint32_t gw) {
        const float2 f = pair_to_float2<T>(xw);
        sum_sq = fmaf(f.x, f.x, fmaf(f.y, f.y, sum_sq));
        xw = multiply_pairs<T>(xw, gw);
    };
    scale_pair(xv.x, g.x);
    scale_pair(xv.y, g.y);
    scale_pair(xv.z, g.z);
    scale_pair(xv.w, g.w);
}

// Sum over the 4 lanes of row group g, which all hold squares of token g's x.
__device__ __forceinline__ float reduce_row_group(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Epilogue of one lane: the m16n8 accumulator layout gives lane (g, t) W rows row_lo and
// row_lo + 8 for tokens 2t and 2t + 1. Each product is multiplied by its token's scale (the RMS
// normalisation, or 1) and written to out [tokens, n], or added to it when `accumulate`.
template <typename T>
__device__ __forceinline__ void store_lane_outputs(T* out, const float (&c)[4], int row_lo, int t, int tokens, int n,
                                                   const float (&scale)[2], bool accumulate) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int token = 2 * t + j;
        if (token >= tokens) continue;
        const int64_t lo = (int64_t)token * n + row_lo, hi = lo + 8;
        if (row_lo < n) out[lo] = from_float<T>(c[j] * scale[j] + (accumulate ? to_float(out[lo]) : 0.0f));
        if (row_lo + 8 < n) out[hi] = from_float<T>(c[2 + j] * scale[j] + (accumulate ? to_float(out[hi]) : 0.0f));
    }
}

}  // namespace minfer
