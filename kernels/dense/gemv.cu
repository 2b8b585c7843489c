// Decode GEMV on the tensor cores. One warp step multiplies a 16-row x 32-k tile of W by up to 8
// tokens with two mma.m16n8k16 (the tokens are the n = 8 side), so there are no lane shuffles and
// 1 or 8 tokens cost the same. The kernel is bound by streaming W once: 16-byte no-L1 loads,
// kUnroll steps in flight per warp, the K range of each 16-row tile split over the block's warps and
// reduced in shared memory in a fixed order (deterministic, no atomics, no workspace).
// Fusions (launch.h): with a norm weight g copied to shared memory before the PDL wait, each lane
// multiplies its x chunks by g and sums their squares as they arrive; the per-token RMS scale is
// applied in the epilogue, which can also add into `out` (the residual stream) in place. For the
// MLP's [gate; up] matrix a tile takes gate rows 8i..8i+7 as its rows 0-7 and the matching up rows
// as rows 8-15, so the lane that holds a gate output also holds its up output and writes silu(gate) * up.
#include "gemv.h"
#include "common/device_utils.cuh"

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

    // RMSNorm fusion: adds the squares of this lane's x chunks to `sum_sq`, then x *= g, with g's
    // [K / 8] chunks in shared memory. Chunks past K hold zero x, so any g chunk will do there.
    __device__ __forceinline__ void apply_norm(const uint4* norm_chunks, int chunk, int row_chunks, float& sum_sq) {
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
            const uint4 g = norm_chunks[min(chunk + s * kStepChunks, row_chunks - 1)];
            auto scale_pair = [&](uint32_t& xw, uint32_t gw) {
                const float2 f = pair_to_float2<T>(xw);
                sum_sq = fmaf(f.x, f.x, fmaf(f.y, f.y, sum_sq));
                xw = multiply_pairs<T>(xw, gw);
            };
            scale_pair(xv[s].x, g.x);
            scale_pair(xv[s].y, g.y);
            scale_pair(xv[s].z, g.z);
            scale_pair(xv[s].w, g.w);
        }
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
// Needs K % 8 == 0 and 16-byte aligned x, w and norm_weight (the launcher checks). kNorm: g * x
// feeds the mmas and the outputs are scaled by rsqrt(mean(x^2) + eps); dynamic shared memory K * 2 bytes.
// The fused-norm 2-step variant (the default with a norm) is held to 80 registers, 3 blocks of 8
// warps per SM: it needed 83, which allocates as 88 and fits only 2 (ncu, H200). Others: ptxas's choice.
template <typename T, int kWarps, int kUnroll, bool kNorm, bool kSiluMul>
__global__ void __launch_bounds__(kWarps * 32, kNorm && kUnroll == 2 ? 768 / (kWarps * 32) : 0)
    gemv_mma_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ norm_weight,
                    T* __restrict__ out, int tokens, int n, int k, float eps, bool accumulate) {
    static_assert(kWarps > 1, "the epilogue reduces the warps' partials in shared memory");
    extern __shared__ uint4 norm_chunks[];  // kNorm: g
    allow_dependents_to_launch();
    const int lane_id = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane_id >> 2, t = lane_id & 3;
    const int row_chunks = k / kChunk;
    const uint4* w_chunks = reinterpret_cast<const uint4*>(w);
    const int inter = n / 2;  // kSiluMul: gate rows [0, inter), up rows [inter, n)
    const int row = kSiluMul ? blockIdx.x * 8 + g : blockIdx.x * kTileRows + g;
    LaneRows lane;  // rows past the end re-read the last one
    lane.row_lo = w_chunks + (int64_t)min(row, (kSiluMul ? inter : n) - 1) * row_chunks;
    lane.row_hi = w_chunks + (int64_t)(kSiluMul ? inter + min(row, inter - 1) : min(row + 8, n - 1)) * row_chunks;
    lane.x = reinterpret_cast<const uint4*>(x) + (int64_t)min(g, tokens - 1) * row_chunks;

    const int full_steps = k / kStepK;
    const int batches = full_steps / kUnroll;
    auto batch_chunk = [&](int b) { return b * kUnroll * kStepChunks + t; };

    float acc[2][4] = {};
    float sum_sq = 0.0f;  // kNorm: squares of token g's x over this lane's chunks
    bool norm_staged = false;
    auto multiply = [&](auto& steps, int chunk) {
        if constexpr (kNorm) {
            if (!norm_staged) {  // this warp's g chunks (copied below) have landed
                cp_async_wait<0>();
                __syncwarp();
                norm_staged = true;
            }
            steps.apply_norm(norm_chunks, chunk, row_chunks, sum_sq);
        }
        steps.multiply(acc);
    };
    // Weights need not wait. With the norm fused (qkv, gate_up, lm_head: they follow an o or down
    // GEMV that fills the GPU) both register sets are filled before the PDL wait, so a block that
    // becomes resident while that GEMV drains has two batches on the way. The plain variants load one:
    // the o GEMV's blocks wait through the attention, and their early loads slowed it (H200 timeline).
    constexpr bool kBothSetsBeforeWait = kNorm;
    WarpSteps<T, kUnroll> even, odd;
    if (warp < batches) even.load_weights(lane, batch_chunk(warp));
    if (kBothSetsBeforeWait && warp + kWarps < batches) odd.load_weights(lane, batch_chunk(warp + kWarps));
    if constexpr (kNorm) {
        // g is a weight too: each warp copies the chunks its own steps read (below) into shared
        // memory, asynchronously, so only its first multiply waits for them and no block barrier
        // stands between a block's start and its second batch of loads.
        const uint4* g_chunks = reinterpret_cast<const uint4*>(norm_weight);
        auto stage = [&](int first, int count) {
            for (int i = lane_id; i < count; i += 32) cp_async_16(smem_addr(norm_chunks + first + i), g_chunks + first + i);
        };
        for (int b = warp; b < batches; b += kWarps) stage(b * kUnroll * kStepChunks, kUnroll * kStepChunks);
        for (int s = batches * kUnroll + warp; s < full_steps; s += kWarps) stage(s * kStepChunks, kStepChunks);
        if (warp == kWarps - 1 && full_steps * kStepK < k)
            stage(full_steps * kStepChunks, row_chunks - full_steps * kStepChunks);
        cp_async_commit();
    }
    wait_for_previous_kernel();
    // The residual is read here, so its L2 round trip overlaps the multiplies instead of following the
    // block's reduction (warp 0 writes the outputs).
    float residual[2][2] = {};  // [token 2t + j][row, row + 8]
    if (!kSiluMul && accumulate && warp == 0) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int64_t lo = (int64_t)(2 * t + j) * n + row;
            if (2 * t + j < tokens && row < n) residual[j][0] = to_float(out[lo]);
            if (2 * t + j < tokens && row + 8 < n) residual[j][1] = to_float(out[lo + 8]);
        }
    }
    if (warp < batches) even.load_x(lane, batch_chunk(warp));
    if (kBothSetsBeforeWait && warp + kWarps < batches) odd.load_x(lane, batch_chunk(warp + kWarps));
    for (int b = warp; b < batches; b += 2 * kWarps) {  // one set in flight while the other multiplies
        if (!kBothSetsBeforeWait && b + kWarps < batches) odd.load(lane, batch_chunk(b + kWarps));
        multiply(even, batch_chunk(b));
        if (kBothSetsBeforeWait && b + 2 * kWarps < batches) even.load(lane, batch_chunk(b + 2 * kWarps));
        if (b + kWarps >= batches) break;
        if (!kBothSetsBeforeWait && b + 2 * kWarps < batches) even.load(lane, batch_chunk(b + 2 * kWarps));
        multiply(odd, batch_chunk(b + kWarps));
        if (kBothSetsBeforeWait && b + 3 * kWarps < batches) odd.load(lane, batch_chunk(b + 3 * kWarps));
    }
    for (int s = batches * kUnroll + warp; s < full_steps; s += kWarps) {
        WarpSteps<T, 1> step;
        step.load(lane, s * kStepChunks + t);
        multiply(step, s * kStepChunks + t);
    }
    if (warp == kWarps - 1 && full_steps * kStepK < k) {
        const int chunk = full_steps * kStepChunks + t;
        WarpSteps<T, 1> step;
        step.load(lane, chunk, chunk < row_chunks);
        multiply(step, chunk);
    }

    float c[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) c[i] = acc[0][i] + acc[1][i];
    __shared__ float4 partial[kWarps - 1][32];
    __shared__ float sum_sq_part[kNorm ? kWarps : 1][8];
    if (warp > 0) partial[warp - 1][lane_id] = make_float4(c[0], c[1], c[2], c[3]);
    if constexpr (kNorm) {
        sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, 1);  // the 4 lanes of row group g hold token g
        sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, 2);
        if (t == 0) sum_sq_part[warp][g] = sum_sq;
    }
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
    // mma accumulator layout: lane (g, t) holds rows g and g + 8 for tokens 2t and 2t + 1.
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int token = 2 * t + j;
        if (token >= tokens) continue;
        float scale = 1.0f;
        if constexpr (kNorm) scale = rms_scale(sum_sq_part, token, k, eps);
        if constexpr (kSiluMul) {
            const float gate = c[j] * scale, up = c[2 + j] * scale;
            if (row < inter) out[(int64_t)token * inter + row] = from_float<T>(silu_times(gate, up));
            continue;
        }
        const int64_t lo = (int64_t)token * n + row, hi = lo + 8;
        if (row < n) out[lo] = from_float<T>(c[j] * scale + residual[j][0]);
        if (row + 8 < n) out[hi] = from_float<T>(c[2 + j] * scale + residual[j][1]);
    }
}

// Fallback for rows that are not 16-byte aligned (K % 8 != 0, or offset views): one warp per output
// row (with silu_mul: per gate row and its up row), scalar loads. Correct at any shape, about an
// order of magnitude slower than the tensor-core path.
template <typename T>
__global__ void gemv_scalar_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                   const T* __restrict__ norm_weight, T* __restrict__ out, int tokens, int n, int k,
                                   float eps, bool accumulate, bool silu_mul) {
    const int lane = threadIdx.x & 31;
    const int outputs = silu_mul ? n / 2 : n;
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= outputs) return;
    const T* w_row = w + (int64_t)row * k;
    const T* up_row = w + (int64_t)(row + outputs) * k;  // silu_mul only
    float acc[kGemvMaxTokens] = {}, up_acc[kGemvMaxTokens] = {}, sum_sq[kGemvMaxTokens] = {};
    for (int i = lane; i < k; i += 32) {
        const float wv = to_float(w_row[i]);
        const float uv = silu_mul ? to_float(up_row[i]) : 0.0f;
        const float gv = norm_weight ? to_float(norm_weight[i]) : 1.0f;
#pragma unroll
        for (int tok = 0; tok < kGemvMaxTokens; ++tok) {
            if (tok >= tokens) break;
            float xv = to_float(x[(int64_t)tok * k + i]);
            if (norm_weight) {
                sum_sq[tok] = fmaf(xv, xv, sum_sq[tok]);
                xv = to_float(from_float<T>(xv * gv));  // rounded as on the tensor-core path
            }
            acc[tok] = fmaf(wv, xv, acc[tok]);
            up_acc[tok] = fmaf(uv, xv, up_acc[tok]);
        }
    }
    store_scalar_projection(acc, up_acc, sum_sq, out, tokens, outputs, row, k, eps, norm_weight != nullptr, accumulate,
                            silu_mul);
}

struct GemvArgs {
    const void* x;
    const void* w;
    void* out;
    int tokens, n, k;
    ProjectionFusion fusion;
    cudaStream_t stream;
};

template <typename T, int kWarps, int kUnroll, bool kNorm, bool kSiluMul>
void launch_mma(const GemvArgs& a) {
    const auto kernel = gemv_mma_kernel<T, kWarps, kUnroll, kNorm, kSiluMul>;
    const int smem = kNorm ? a.k * (int)sizeof(T) : 0;
    if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    const int tiles = kSiluMul ? ceil_div(a.n / 2, 8) : ceil_div(a.n, kTileRows);
    launch_with_pdl(kernel, dim3((unsigned)tiles), dim3(kWarps * 32), smem, a.stream, true,
                    static_cast<const T*>(a.x), static_cast<const T*>(a.w), static_cast<const T*>(a.fusion.norm_weight),
                    static_cast<T*>(a.out), a.tokens, a.n, a.k, a.fusion.eps, a.fusion.accumulate);
}

template <typename T, int kWarps, int kUnroll>
void launch_norm_or_plain(const GemvArgs& a) {
    if (a.fusion.norm_weight)
        return a.fusion.silu_mul ? launch_mma<T, kWarps, kUnroll, true, true>(a)
                                 : launch_mma<T, kWarps, kUnroll, true, false>(a);
    return launch_mma<T, kWarps, kUnroll, false, false>(a);
}

template <typename T, int kWarps>
void launch_warps(const GemvArgs& a, int unroll) {
    switch (unroll) {
        case 2: return launch_norm_or_plain<T, kWarps, 2>(a);
        case 4: return launch_norm_or_plain<T, kWarps, 4>(a);
        default:  // 16 warps x 8 steps would spill: 16 warps take 4
            if constexpr (kWarps < 16) return launch_norm_or_plain<T, kWarps, 8>(a);
            else return launch_norm_or_plain<T, kWarps, 4>(a);
    }
}

// Measured launch configurations (docs/perf-notes.md, "GEMV"): long rows want more warps per tile,
// many tiles per SM a deeper unroll (the H200 sweep moved the threshold from 8 to 4 tiles per SM).
// With the RMSNorm fused, 8 warps x 2 steps was the fastest variant on every shape (H200 sweep).
GemvTuning default_tuning(int n, int k, bool norm) {
    const int sm_count = multiprocessors(current_device());
    if (norm) return {8, 2};
    if (k >= 8192) return {16, 4};
    if (ceil_div(n, kTileRows) >= 4 * sm_count) return {8, 8};
    return {8, 4};
}

template <typename T>
void launch_typed(const GemvArgs& a, GemvTuning tuning) {
    auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    const bool aligned = a.k % kChunk == 0 && aligned16(a.x) && aligned16(a.w) && aligned16(a.fusion.norm_weight);
    // The silu epilogue is instantiated with the norm only (the MLP's gate_up); ops.gemv runs a
    // GEMV and the silu_mul kernel otherwise, so a direct call without a norm gets the scalar path.
    if (!aligned || (a.fusion.silu_mul && !a.fusion.norm_weight)) {
        constexpr int kRowsPerBlock = 8;
        const int outputs = a.fusion.silu_mul ? a.n / 2 : a.n;
        gemv_scalar_kernel<T><<<ceil_div(outputs, kRowsPerBlock), kRowsPerBlock * 32, 0, a.stream>>>(
            static_cast<const T*>(a.x), static_cast<const T*>(a.w), static_cast<const T*>(a.fusion.norm_weight),
            static_cast<T*>(a.out), a.tokens, a.n, a.k, a.fusion.eps, a.fusion.accumulate, a.fusion.silu_mul);
        return;
    }
    const GemvTuning chosen = default_tuning(a.n, a.k, a.fusion.norm_weight != nullptr);
    const int warps = tuning.warps_per_block > 0 ? tuning.warps_per_block : chosen.warps_per_block;
    const int unroll = tuning.unroll > 0 ? tuning.unroll : chosen.unroll;
    switch (warps) {
        case 4: return launch_warps<T, 4>(a, unroll);
        case 8: return launch_warps<T, 8>(a, unroll);
        default: return launch_warps<T, 16>(a, unroll);
    }
}

}  // namespace

void launch_gemv(const void* x, const void* w, void* out, int64_t tokens, int64_t n, int64_t k, DType dtype,
                 const ProjectionFusion& fusion, const GemvTuning& tuning, cudaStream_t stream) {
    const GemvArgs args{x, w, out, (int)tokens, (int)n, (int)k, fusion, stream};
    switch (dtype) {
        case DType::kFloat16: launch_typed<half>(args, tuning); break;
        case DType::kBFloat16: launch_typed<__nv_bfloat16>(args, tuning); break;
        case DType::kFloat32: break;  // rejected by the binding: the tensor cores take 16-bit inputs
    }
}

}  // namespace minfer
