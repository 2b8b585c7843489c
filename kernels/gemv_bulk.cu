// Decode GEMV on sm_90: W streams into shared memory through bulk asynchronous copies (TMA), all
// issued before the PDL wait, and the tensor cores read it from there (warp step and fragment
// layout: gemv_fragments.cuh).
//
// Why: the register-streaming kernel (gemv.cu) keeps only a few KB per warp in flight, so each
// 16-row tile drains slowly at the end of a kernel, and its successor can prefetch only one batch
// before its own wait. Here a block owns 16 rows x a range of 512-column stages (64 KB by
// default), copies all of it at once (one bulk copy per row and stage), and only then waits for
// the previous kernel; while kernel N drains, kernel N+1's blocks already hold their weights.
// Long rows are split over the blocks of a cluster (blockIdx.y), which add their partial sums
// through distributed shared memory in rank order: deterministic, no workspace, no atomics.
//
// Shared memory per stage: 16 rows at a pitch of 1040 bytes (16 of padding), then g's 512 columns
// when the RMSNorm is fused. With that pitch, row r starts in 16-byte bank group r mod 8; the mma
// row -> stored row map (m >> 1) + 4 (m & 1) puts the two rows a quarter-warp reads (g = 2q, 2q + 1)
// four groups apart, so the 16-byte fragment loads have no bank conflicts.
#include "gemv.h"
#include "gemv_fragments.cuh"
#include "sm90_async.cuh"

namespace minfer {

namespace {

constexpr int kWarps = 4;
constexpr int kStageK = 512;                                     // columns of one row per stage
constexpr int kRowPitch = kStageK * 2 + 16;                      // bytes
constexpr int kWeightBytes = kGemvTileRows * kRowPitch;          // one stage of W
constexpr int kBarrierBytes = 128;                               // one mbarrier per stage, before the stages
constexpr int kMaxStagesPerBlock = kBarrierBytes / 8;
constexpr int kMaxSplits = 8;                                    // portable cluster size
constexpr int kSmemLimit = 227 * 1024;

constexpr int stage_bytes(bool norm) { return kWeightBytes + (norm ? kStageK * 2 : 0); }
constexpr int smem_bytes(bool norm, int stages) { return kBarrierBytes + stages * stage_bytes(norm); }

// After the stages are consumed their memory holds the reductions: the block's warps' partials,
// then (rank 0 of a cluster) one slot per peer.
struct PartialSums {
    float4 c[32];   // per lane: rows g, g + 8 x tokens 2t, 2t + 1
    float sq[8];    // per token: sum of x^2 (RMSNorm)
};
static_assert((kWarps + kMaxSplits) * sizeof(PartialSums) <= stage_bytes(false), "reductions fit in one stage");


template <typename T, bool kNorm>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_bulk_kernel(const T* x, const T* __restrict__ w, const T* __restrict__ norm_weight, T* out, int tokens,
                     int n, int k, float eps, bool accumulate, int total_stages) {
#ifdef MINFER_SM90_ASYNC
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr int kStageBytes = stage_bytes(kNorm);
    constexpr int kStageChunks = kStageK / kGemvChunk;        // 64
    constexpr int kStepsPerWarp = kStageChunks / 4 / kWarps;  // 16-row x 32-k steps per warp per stage
    auto stored_row = [](int mma_row) { return (mma_row >> 1) + 4 * (mma_row & 1); };
    const int lane_id = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane_id >> 2, t = lane_id & 3;
    const int splits = gridDim.y, split = blockIdx.y;
    const int first = split * total_stages / splits;
    const int count = (split + 1) * total_stages / splits - first;
    const int row_chunks = k / kGemvChunk;
    const int tile_row = blockIdx.x * kGemvTileRows;
    const int rows = min(kGemvTileRows, n - tile_row);
    const uint32_t barriers = smem_addr(smem);
    unsigned char* stages = smem + kBarrierBytes;
    auto columns = [&](int s) { return min(kStageK, k - (first + s) * kStageK); };

    if (threadIdx.x == 0) {
        for (int s = 0; s < count; ++s) mbar_init(barriers + 8 * s, 1);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (warp == 0) {  // W (and g) are weights: copied before the wait
        if (lane_id == 0)
            for (int s = 0; s < count; ++s)
                mbar_arrive_expect_tx(barriers + 8 * s, (rows + (kNorm ? 1 : 0)) * columns(s) * 2);
        __syncwarp();
        constexpr int kCopies = kGemvTileRows + (kNorm ? 1 : 0);  // per stage: 16 rows, then g
        for (int i = lane_id; i < count * kCopies; i += 32) {
            const int s = i / kCopies, r = i % kCopies;
            const int64_t column = (int64_t)(first + s) * kStageK;
            const uint32_t stage = smem_addr(stages + s * kStageBytes);
            if (r < rows)
                bulk_copy_to_shared(stage + r * kRowPitch, w + (int64_t)(tile_row + r) * k + column, columns(s) * 2,
                                    barriers + 8 * s);
            else if (kNorm && r == kGemvTileRows)
                bulk_copy_to_shared(stage + kWeightBytes, norm_weight + column, columns(s) * 2, barriers + 8 * s);
        }
    }
    allow_dependents_to_launch();
    wait_for_previous_kernel();

    // Lanes past the last token read token 0: their B column feeds outputs that are never stored.
    const uint4* x_chunks = reinterpret_cast<const uint4*>(x) + (int64_t)min(g, tokens - 1) * row_chunks;
    const int lo_offset = stored_row(g) * kRowPitch, hi_offset = lo_offset + 8 * kRowPitch;
    auto chunk_in_stage = [&](int i) { return (warp + kWarps * i) * 4 + t; };
    uint4 x_next[kStepsPerWarp];
    auto load_x = [&](int s) {
#pragma unroll
        for (int i = 0; i < kStepsPerWarp; ++i) {
            const int chunk = (first + s) * kStageChunks + chunk_in_stage(i);
            x_next[i] = chunk < row_chunks ? load_coherent_16B(x_chunks + chunk) : make_uint4(0, 0, 0, 0);
        }
    };
    float acc[2][4] = {};
    float sum_sq = 0.0f;  // kNorm: squares of token g's x over this lane's chunks
    load_x(0);
    for (int s = 0; s < count; ++s) {
        uint4 xv[kStepsPerWarp];
#pragma unroll
        for (int i = 0; i < kStepsPerWarp; ++i) xv[i] = x_next[i];
        if (s + 1 < count) load_x(s + 1);
        mbar_wait(barriers + 8 * s, 0);
        const unsigned char* stage = stages + s * kStageBytes;
#pragma unroll
        for (int i = 0; i < kStepsPerWarp; ++i) {
            const int chunk = chunk_in_stage(i);
            if ((first + s) * kStageChunks + chunk >= row_chunks) continue;  // past K: nothing was copied
            const uint4 lo = *reinterpret_cast<const uint4*>(stage + lo_offset + chunk * 16);
            const uint4 hi = *reinterpret_cast<const uint4*>(stage + hi_offset + chunk * 16);
            if constexpr (kNorm)
                scale_chunk_by_norm<T>(xv[i], *reinterpret_cast<const uint4*>(stage + kWeightBytes + chunk * 16),
                                       sum_sq);
            multiply_chunk<T>(acc, lo, hi, xv[i]);
        }
    }

    // Block sum over the warps, in shared memory the stages no longer need.
    PartialSums* partial = reinterpret_cast<PartialSums*>(stages);
    __syncthreads();
    partial[warp].c[lane_id] = make_float4(acc[0][0] + acc[1][0], acc[0][1] + acc[1][1], acc[0][2] + acc[1][2],
                                           acc[0][3] + acc[1][3]);
    if constexpr (kNorm) {
        sum_sq = reduce_row_group(sum_sq);
        if (t == 0) partial[warp].sq[g] = sum_sq;
    }
    __syncthreads();
    float4 c = partial[0].c[lane_id];
    float sq = kNorm ? partial[0].sq[lane_id & 7] : 0.0f;  // lane l: token l % 8
#pragma unroll
    for (int i = 1; i < kWarps; ++i) {
        const float4 p = partial[i].c[lane_id];
        c = make_float4(c.x + p.x, c.y + p.y, c.z + p.z, c.w + p.w);
        if constexpr (kNorm) sq += partial[i].sq[lane_id & 7];
    }

    if (splits > 1) {  // rank r's sums go to slot r of rank 0, which adds them in rank order
        PartialSums* slots = partial + kWarps;
        const uint32_t rank = cluster_rank();
        cluster_sync();  // every CTA has started (its shared memory exists) and rank 0 is done with its stages
        if (rank > 0 && warp == 0) {
            store_cluster_f32x4(cluster_peer_address(smem_addr(&slots[rank].c[lane_id]), 0), c);
            if (kNorm && lane_id < 8) store_cluster_f32(cluster_peer_address(smem_addr(&slots[rank].sq[lane_id]), 0), sq);
        }
        cluster_sync();
        if (rank > 0) return;
        for (int r = 1; r < splits; ++r) {
            const float4 p = slots[r].c[lane_id];
            c = make_float4(c.x + p.x, c.y + p.y, c.z + p.z, c.w + p.w);
            if constexpr (kNorm) sq += slots[r].sq[lane_id & 7];
        }
    }
    if (warp > 0) return;
    float scale[2] = {1.0f, 1.0f};
    if constexpr (kNorm) {
        scale[0] = rsqrtf(__shfl_sync(0xffffffffu, sq, 2 * t) / k + eps);
        scale[1] = rsqrtf(__shfl_sync(0xffffffffu, sq, 2 * t + 1) / k + eps);
    }
    const float c_lane[4] = {c.x, c.y, c.z, c.w};
    store_lane_outputs<T>(out, c_lane, tile_row + stored_row(g), t, tokens, n, scale, accumulate);
#endif
}

}  // namespace

GemvBulkPlan plan_gemv_bulk(int64_t k, int stages_per_block) {
    GemvBulkPlan plan;
    plan.total_stages = (int)((k + kStageK - 1) / kStageK);
    plan.splits = std::min(kMaxSplits, ceil_div(plan.total_stages, std::max(stages_per_block, 1)));
    plan.stages_per_block = ceil_div(plan.total_stages, plan.splits);
    plan.fits = plan.stages_per_block <= kMaxStagesPerBlock && smem_bytes(true, plan.stages_per_block) <= kSmemLimit;
    return plan;
}

template <typename T, bool kNorm>
bool launch_bulk_typed(const void* x, const void* w, void* out, int tokens, int n, int k,
                       const ProjectionFusion& fusion, const GemvBulkPlan& plan, cudaStream_t stream) {
    constexpr auto kernel = gemv_bulk_kernel<T, kNorm>;
    if (!opt_in_shared_memory<kernel>(kSmemLimit)) return false;
    launch_with_pdl_in_clusters(kernel, dim3((unsigned)ceil_div(n, kGemvTileRows), (unsigned)plan.splits),
                                dim3(1, (unsigned)plan.splits, 1), dim3(kWarps * 32),
                                smem_bytes(kNorm, plan.stages_per_block), stream, true, static_cast<const T*>(x),
                                static_cast<const T*>(w), static_cast<const T*>(fusion.norm_weight),
                                static_cast<T*>(out), tokens, n, k, fusion.eps, fusion.accumulate, plan.total_stages);
    return true;
}

bool launch_gemv_bulk(const void* x, const void* w, void* out, int tokens, int n, int k, DType dtype,
                      const ProjectionFusion& fusion, const GemvBulkPlan& plan, cudaStream_t stream) {
    const bool norm = fusion.norm_weight != nullptr;
    switch (dtype) {
        case DType::kFloat16:
            return norm ? launch_bulk_typed<half, true>(x, w, out, tokens, n, k, fusion, plan, stream)
                        : launch_bulk_typed<half, false>(x, w, out, tokens, n, k, fusion, plan, stream);
        case DType::kBFloat16:
            return norm ? launch_bulk_typed<__nv_bfloat16, true>(x, w, out, tokens, n, k, fusion, plan, stream)
                        : launch_bulk_typed<__nv_bfloat16, false>(x, w, out, tokens, n, k, fusion, plan, stream);
        case DType::kFloat32: return false;
    }
    return false;
}

}  // namespace minfer
