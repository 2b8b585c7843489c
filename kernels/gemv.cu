// Decode GEMV on the tensor cores. One warp step multiplies a 16-row x 32-k tile of W by up to 8
// tokens with two mma.m16n8k16 (the tokens are the n = 8 side), so there are no lane shuffles and
// 1 or 8 tokens cost the same. The kernel is bound by streaming W once: 16-byte no-L1 loads,
// kUnroll steps in flight per warp, the K range of each 16-row tile split over the block's warps and
// reduced in shared memory in a fixed order (deterministic, no atomics, no workspace).
#include "gemv.h"
#include "device_utils.cuh"

namespace minfer {

namespace {

constexpr int kTileRows = 16;                 // mma M
constexpr int kChunk = 8;                     // elements in one 16-byte load
constexpr int kStepChunks = 4;                // chunks of one row per warp step (lanes t = 0..3)
constexpr int kStepK = kStepChunks * kChunk;  // 32: two k16 mmas

// What lane (g, t) reads: rows g and g + 8 of its tile, and x of token g. Lanes past the last token
// read token 0 instead: their B column only feeds output columns that are never stored.
struct LaneRows {
    const uint4* row_lo;
    const uint4* row_hi;
    const uint4* x;
};

// kSteps warp steps, held in registers between load and multiply.
// Lane (g, t) holds chunk c = step * 4 + t of its rows and of token g's x. A dot product may sum k in
// any order, so the chunk's 8 elements go to the k slots the mma fragment layout gives this lane:
// pairs {0,1},{2,3} are slots (2t, 2t+1), (2t+8, 2t+9) of the first k16 mma, pairs {4,5},{6,7} the
// same slots of the second. A and B get the same permutation, so the product is exact.
// `valid` is false only for the lanes of a last, partial step (K % 32 != 0): they feed zeros.
template <typename T, int kSteps>
struct WarpSteps {
    uint4 lo[kSteps], hi[kSteps], xv[kSteps];

    __device__ __forceinline__ void load_weights(const LaneRows& lane, int chunk, bool valid = true) {
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
            lo[s] = valid ? load_stream_16B(lane.row_lo + chunk + s * kStepChunks) : make_uint4(0, 0, 0, 0);
            hi[s] = valid ? load_stream_16B(lane.row_hi + chunk + s * kStepChunks) : make_uint4(0, 0, 0, 0);
        }
    }

    __device__ __forceinline__ void load_x(const LaneRows& lane, int chunk, bool valid = true) {
#pragma unroll
        for (int s = 0; s < kSteps; ++s) xv[s] = valid ? load_coherent_16B(lane.x + chunk + s * kStepChunks) : make_uint4(0, 0, 0, 0);
    }

    __device__ __forceinline__ void load(const LaneRows& lane, int chunk, bool valid = true) {
        load_weights(lane, chunk, valid);
        load_x(lane, chunk, valid);
    }

    // Two accumulators, so consecutive mmas do not wait on each other.
    __device__ __forceinline__ void multiply(float (&acc)[2][4]) const {
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
            const uint32_t first[4] = {lo[s].x, hi[s].x, lo[s].y, hi[s].y};
            const uint32_t second[4] = {lo[s].z, hi[s].z, lo[s].w, hi[s].w};
            mma_m16n8k16<T>(acc[0], first, xv[s].x, xv[s].y);
            mma_m16n8k16<T>(acc[1], second, xv[s].z, xv[s].w);
        }
    }
};

// One block per 16-row tile; its kWarps warps take interleaved batches of kUnroll steps along K.
// Each warp keeps one batch in flight while it multiplies the previous one (two register sets:
// otherwise ptxas interleaves loads with the mmas that wait on them and few bytes stay in flight).
// Needs K % 8 == 0 and 16-byte aligned x and w (the launcher checks).
template <typename T, int kWarps, int kUnroll>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_mma_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out, int tokens, int n,
                    int k) {
    allow_dependents_to_launch();
    const int lane_id = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane_id >> 2, t = lane_id & 3;
    const int row = blockIdx.x * kTileRows + g;
    const int row_chunks = k / kChunk;
    const uint4* w_chunks = reinterpret_cast<const uint4*>(w);
    LaneRows lane;
    lane.row_lo = w_chunks + (int64_t)min(row, n - 1) * row_chunks;  // rows past N re-read the last
    lane.row_hi = w_chunks + (int64_t)min(row + 8, n - 1) * row_chunks;
    lane.x = reinterpret_cast<const uint4*>(x) + (int64_t)min(g, tokens - 1) * row_chunks;

    const int full_steps = k / kStepK;
    const int batches = full_steps / kUnroll;
    auto batch_chunk = [&](int b) { return b * kUnroll * kStepChunks + t; };

    float acc[2][4] = {};
    WarpSteps<T, kUnroll> even, odd;
    if (warp < batches) even.load_weights(lane, batch_chunk(warp));  // weights need not wait
    wait_for_previous_kernel();
    if (warp < batches) even.load_x(lane, batch_chunk(warp));
    for (int b = warp; b < batches; b += 2 * kWarps) {
        if (b + kWarps < batches) odd.load(lane, batch_chunk(b + kWarps));
        even.multiply(acc);
        if (b + kWarps >= batches) break;
        if (b + 2 * kWarps < batches) even.load(lane, batch_chunk(b + 2 * kWarps));
        odd.multiply(acc);
    }
    for (int s = batches * kUnroll + warp; s < full_steps; s += kWarps) {
        WarpSteps<T, 1> step;
        step.load(lane, s * kStepChunks + t);
        step.multiply(acc);
    }
    if (warp == kWarps - 1 && full_steps * kStepK < k) {
        const int chunk = full_steps * kStepChunks + t;
        WarpSteps<T, 1> step;
        step.load(lane, chunk, chunk < row_chunks);
        step.multiply(acc);
    }

    float c[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) c[i] = acc[0][i] + acc[1][i];
    if constexpr (kWarps > 1) {
        __shared__ float4 partial[kWarps - 1][32];
        if (warp > 0) partial[warp - 1][lane_id] = make_float4(c[0], c[1], c[2], c[3]);
        __syncthreads();
        if (warp > 0) return;
#pragma unroll
        for (int i = 0; i < kWarps - 1; ++i) {
            const float4 p = partial[i][lane_id];
            c[0] += p.x;
            c[1] += p.y;
            c[2] += p.z;
            c[3] += p.w;
        }
    }
    // mma accumulator layout: lane (g, t) holds rows g and g + 8 for tokens 2t and 2t + 1.
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int token = 2 * t + j;
        if (token >= tokens) continue;
        if (row < n) out[(int64_t)token * n + row] = from_float<T>(c[j]);
        if (row + 8 < n) out[(int64_t)token * n + row + 8] = from_float<T>(c[2 + j]);
    }
}

// Fallback for rows that are not 16-byte aligned (K % 8 != 0, or offset views): one warp per row,
// scalar loads. Correct at any shape, about an order of magnitude slower than the tensor-core path.
template <typename T>
__global__ void gemv_scalar_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out,
                                   int tokens, int n, int k) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= n) return;
    float acc[kGemvMaxTokens] = {};
    for (int i = lane; i < k; i += 32) {
        const float wv = to_float(w[(int64_t)row * k + i]);
#pragma unroll
        for (int tok = 0; tok < kGemvMaxTokens; ++tok)
            if (tok < tokens) acc[tok] += wv * to_float(x[(int64_t)tok * k + i]);
    }
#pragma unroll
    for (int tok = 0; tok < kGemvMaxTokens; ++tok) {
        if (tok >= tokens) break;
        const float sum = warp_sum(acc[tok]);
        if (lane == 0) out[(int64_t)tok * n + row] = from_float<T>(sum);
    }
}

template <typename T, int kWarps, int kUnroll>
void launch_mma(const T* x, const T* w, T* out, int tokens, int n, int k, cudaStream_t stream) {
    launch_with_pdl(gemv_mma_kernel<T, kWarps, kUnroll>, dim3((unsigned)ceil_div(n, kTileRows)), dim3(kWarps * 32), 0,
                    stream, true, x, w, out, tokens, n, k);
}

template <typename T, int kWarps>
void launch_warps(const T* x, const T* w, T* out, int tokens, int n, int k, int unroll, cudaStream_t stream) {
    switch (unroll) {
        case 2: return launch_mma<T, kWarps, 2>(x, w, out, tokens, n, k, stream);
        case 4: return launch_mma<T, kWarps, 4>(x, w, out, tokens, n, k, stream);
        default:  // 16 warps x 8 steps would spill: 16 warps take 4
            if constexpr (kWarps < 16) return launch_mma<T, kWarps, 8>(x, w, out, tokens, n, k, stream);
            else return launch_mma<T, kWarps, 4>(x, w, out, tokens, n, k, stream);
    }
}

// Measured launch configurations (docs/perf-notes.md, "GEMV"): long rows want more warps per tile,
// many tiles per SM a deeper unroll (the H200 sweep moved the threshold from 8 to 4 tiles per SM).
GemvTuning default_tuning(int n, int k) {
    int device = 0, sm_count = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
    if (k >= 8192) return {16, 4};
    if (ceil_div(n, kTileRows) >= 4 * sm_count) return {8, 8};
    return {8, 4};
}

template <typename T>
void launch_typed(const void* x_ptr, const void* w_ptr, void* out_ptr, int tokens, int n, int k, GemvTuning tuning,
                  cudaStream_t stream) {
    const T* x = static_cast<const T*>(x_ptr);
    const T* w = static_cast<const T*>(w_ptr);
    T* out = static_cast<T*>(out_ptr);
    const bool aligned = k % kChunk == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(w) % 16 == 0;
    if (!aligned) {
        constexpr int kRowsPerBlock = 8;
        gemv_scalar_kernel<T><<<ceil_div(n, kRowsPerBlock), kRowsPerBlock * 32, 0, stream>>>(x, w, out, tokens, n, k);
        return;
    }
    const GemvTuning chosen = default_tuning(n, k);
    const int warps = tuning.warps_per_block > 0 ? tuning.warps_per_block : chosen.warps_per_block;
    const int unroll = tuning.unroll > 0 ? tuning.unroll : chosen.unroll;
    switch (warps) {
        case 4: return launch_warps<T, 4>(x, w, out, tokens, n, k, unroll, stream);
        case 8: return launch_warps<T, 8>(x, w, out, tokens, n, k, unroll, stream);
        default: return launch_warps<T, 16>(x, w, out, tokens, n, k, unroll, stream);
    }
}

}  // namespace

void launch_gemv(const void* x, const void* w, void* out, int64_t tokens, int64_t n, int64_t k, DType dtype,
                 const GemvTuning& tuning, cudaStream_t stream) {
    switch (dtype) {
        case DType::kFloat16: launch_typed<half>(x, w, out, (int)tokens, (int)n, (int)k, tuning, stream); break;
        case DType::kBFloat16:
            launch_typed<__nv_bfloat16>(x, w, out, (int)tokens, (int)n, (int)k, tuning, stream);
            break;
        case DType::kFloat32: break;  // rejected by the binding: the tensor cores take 16-bit inputs
    }
}

}  // namespace minfer
