// Flash-decoding on tensor cores (mma.sync m16n8k16, sm_80+). One block per (split, KV head, batch).
// Each warp streams its own 16-position steps of K and V through a cp.async ring in shared memory,
// so the bytes in flight do not cost registers. S = Q K^T puts the G query heads of the KV head
// on the mma's 16 rows (rows >= G are zero), so every K/V byte is read once for all of them; P V
// reuses S's accumulator layout as the A operand. Warps merge in shared memory, splits through the
// workspace: the last block of each KV head to finish (an arrival counter) does the final merge.
// The first ring steps are issued before the PDL wait, so the loads overlap the previous kernels.
// Block-sparse decode (kMode kListedTiles or kSinkWindow) runs the same loop over "rows" that are the kept
// key tiles laid end to end: a 16-row step never crosses a tile, so each step maps to one physical run of 16
// positions. Sink-window finds its tiles by arithmetic on the position: no list loads in the dependent chain.
#include "decode_attention.h"
#include "common/device_utils.cuh"

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace minfer {

namespace {

constexpr int kRows = kDecodeAttnStepRows;
constexpr int kWarps = kDecodeAttnWarps;
constexpr int kThreads = kWarps * 32;
constexpr int kRoundRows = kRows * kWarps;   // a block's share is a multiple of this
constexpr int kKeyTile = kDecodeAttnKeyTile;
enum KeptMode { kDense, kListedTiles, kSinkWindow };
static_assert(kKeyTile % kRows == 0 && kKeyTile % kRoundRows == 0, "steps and shares must not cross a key tile");
// Default K/V ring per warp: 4 steps at D 128, 8 at D 64. Since the first ring steps are issued
// before the PDL wait, the H200 sweep (docs/perf-notes.md, the 2026-11-22 ca3ebae entry) found 4 steps at D 128 faster
// than 2 at every context from 640 to 32k (2 had been best on the H100 without that prefetch).
constexpr int kWarpRingBytes = 32 * 1024;
constexpr int kMaxStages = 12;
constexpr int kMergeBatch = 8;               // partials loaded together by the final merge
constexpr float kLog2e = 1.4426950408889634f;

// wait_group takes an immediate, and the ring depth is picked at launch from the device's shared memory.
__device__ __forceinline__ void cp_async_wait_pending(int n) {
    switch (n) {
        case 0: cp_async_wait<0>(); break;
        case 1: cp_async_wait<1>(); break;
        case 2: cp_async_wait<2>(); break;
        case 3: cp_async_wait<3>(); break;
        case 4: cp_async_wait<4>(); break;
        case 5: cp_async_wait<5>(); break;
        case 6: cp_async_wait<6>(); break;
        case 7: cp_async_wait<7>(); break;
        case 8: cp_async_wait<8>(); break;
        case 9: cp_async_wait<9>(); break;
        default: cp_async_wait<10>(); break;
    }
}

struct AttnParams {
    int64_t q_batch_stride, q_head_stride, max_seq_len;
    int q_heads, kv_heads, group, stages;
    float scale_log2;  // softmax scale * log2(e): scores are kept in base 2
};

template <typename T, int D, int kMode>
__global__ void __launch_bounds__(kThreads)
    decode_attention_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* input_pos,
                            T* __restrict__ out, float* workspace, AttnParams p, DecodeKeptTiles kept) {
    constexpr bool kSparse = kMode != kDense;
    constexpr int kElemsPer16B = 16 / sizeof(T);
    constexpr int kChunks = D / kElemsPer16B;  // 16-byte chunks per K/V row
    constexpr int kKSteps = D / 16;            // mma k-steps over the head dim (S = Q K^T)
    constexpr int kDimTiles = D / 8;           // mma n-tiles over the head dim (O = P V)
    constexpr int kStageElems = 2 * kRows * D; // one step: 16 K rows, then 16 V rows
    static_assert(kChunks % 8 == 0, "the XOR swizzle needs rows of a multiple of 128 bytes");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ int block_is_last;
    T* smem = reinterpret_cast<T*>(smem_raw);

    allow_dependents_to_launch();

    const int split = blockIdx.x, splits = gridDim.x, h = blockIdx.y, b = blockIdx.z, batch = gridDim.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int G = p.group;

    // input_pos and the cache rows before it are read before griddepcontrol.wait: the header's
    // contract is that they were complete before the previous kernel started. Only q and the newest
    // row (input_pos[0], which rope_write_kv has just written) wait for the previous kernel.
    // Every block derives the same equal shares of the live length from the device-side position.
    // Rows: dense, the live positions; sparse, the kept tiles' positions laid end to end (the
    // layout's lists are static, so they too are read before the wait). `newest_row` is the row of
    // the newest position (-1: its tile is not kept).
    const int64_t live = min(max(input_pos[0] + 1, (int64_t)1), p.max_seq_len);
    const int64_t newest = live - 1;
    int64_t rows = live, newest_row = newest;
    const int32_t* tiles = nullptr;
    const int32_t* bits = nullptr;
    int sink_count = 0, window_first = 0;  // sink-window: tiles [0, sink_count), then [window_first, q_tile]
    if constexpr (kMode == kSinkWindow) {
        const int q_tile = (int)(newest / kKeyTile);
        const int64_t block = (int64_t)kept.block_tiles * kKeyTile;
        // The first key block holding one of the last `window` tokens before the block's first query.
        const int64_t reach = (q_tile / kept.block_tiles) * block - kept.window + 2 - block;
        window_first = (reach <= 0 ? 0 : (int)((reach + block - 1) / block)) * kept.block_tiles;
        sink_count = min(kept.sink_tiles, window_first);
        rows = (int64_t)(sink_count + q_tile - window_first + 1) * kKeyTile;
        newest_row = rows - kKeyTile + newest % kKeyTile;
    }
    if constexpr (kMode == kListedTiles) {
        const int q_tile = (int)(newest / kKeyTile);
        const int list = (kept.groups == 1 ? 0 : h) * kept.q_tiles + q_tile;
        const int first = kept.tile_ptr[list], n_kept = kept.tile_ptr[list + 1] - first;
        tiles = kept.key_tiles + first;
        bits = kept.head_bits + first;
        rows = (int64_t)n_kept * kKeyTile;
        newest_row = n_kept > 0 && tiles[n_kept - 1] == q_tile ? rows - kKeyTile + newest % kKeyTile : -1;
        if (n_kept == 0) {  // nothing kept: the first block writes zeros once the previous kernel is done
            if (split != 0) return;
            wait_for_previous_kernel();
            for (int idx = threadIdx.x; idx < G * D; idx += kThreads)
                out[((int64_t)b * p.q_heads + h * G) * D + idx] = from_float<T>(0.0f);
            return;
        }
    }
    const int64_t share = ((rows + splits - 1) / splits + kRoundRows - 1) / kRoundRows * kRoundRows;
    const int n_live = (int)((rows + share - 1) / share);
    const int64_t begin = split * share;
    if (begin >= rows) return;
    const int64_t end = min(begin + share, rows);
    // The cache position of row `row` (the first of a step: the step's 16 positions follow it).
    auto position = [&](int64_t row) -> int64_t {
        if constexpr (kMode == kListedTiles) {
            return (int64_t)tiles[row / kKeyTile] * kKeyTile + row % kKeyTile;
        } else if constexpr (kMode == kSinkWindow) {
            const int tile = (int)(row / kKeyTile);
            return (int64_t)(tile < sink_count ? tile : window_first + tile - sink_count) * kKeyTile + row % kKeyTile;
        } else {
            return row;
        }
    };

    const int64_t head_offset = ((int64_t)b * p.kv_heads + h) * p.max_seq_len * D;
    const T* k_head = k_cache + head_offset;
    const T* v_head = v_cache + head_offset;

    // mma fragment coordinates: row `frag_row` (and +8), columns `frag_col`, +1 (and +8, +9).
    const int frag_row = lane / 4, frag_col = 2 * (lane % 4);

    // This warp takes steps warp, warp + kWarps, ... of the block's share.
    T* ring = smem + (size_t)warp * p.stages * kStageElems;
    const int64_t steps = (end - begin + kRows - 1) / kRows;
    const int my_steps = warp < steps ? (int)((steps - warp + kWarps - 1) / kWarps) : 0;
    auto step_row = [&](int i) { return begin + ((int64_t)i * kWarps + warp) * kRows; };

    // Chunk c of row r sits at chunk c ^ (r % 8): ldmatrix's 8 row reads then hit 8 distinct bank groups.
    // `before_wait`: the newest row is skipped (not even zero-filled) and patched in after the wait.
    auto issue = [&](int i, bool before_wait) {
        const int64_t row0 = step_row(i), pos0 = position(row0);
        T* slot = ring + (i % p.stages) * kStageElems;
#pragma unroll
        for (int j = 0; j < kRows * kChunks / 32; ++j) {
            const int idx = lane + 32 * j, r = idx / kChunks, c = idx % kChunks;
            if (before_wait && row0 + r == newest_row) continue;
            // Rows past the share, and sparse positions past the newest (or of a tile out of range), are
            // zero-filled, never read.
            const bool valid = row0 + r < end && (!kSparse || (uint64_t)(pos0 + r) <= (uint64_t)newest);
            const int64_t src = valid ? (pos0 + r) * D + c * kElemsPer16B : 0;
            const int dst = (r * kChunks + (c ^ (r & 7))) * kElemsPer16B;
            cp_async_16(smem_addr(slot + dst), k_head + src, valid);
            cp_async_16(smem_addr(slot + kRows * D + dst), v_head + src, valid);
        }
    };

    for (int i = 0; i < p.stages - 1; ++i) {
        if (i < my_steps) issue(i, true);
        cp_async_commit();
    }
    // The step holding the newest row, if this warp issued it above: lane l < 2 * kChunks then owns
    // chunk l % kChunks of its K (l < kChunks) or V row.
    const int64_t newest_step = (newest_row - begin) / kRows;
    const int patch_step = newest_row >= begin && newest_row < end && newest_step % kWarps == warp &&
                                   newest_step / kWarps < p.stages - 1
                               ? (int)(newest_step / kWarps) : -1;
    const bool patch_lane = patch_step >= 0 && lane < 2 * kChunks;
    const int patch_chunk = lane % kChunks, patch_row = (int)(newest_row - step_row(max(patch_step, 0)));

    wait_for_previous_kernel();

    uint4 patch = make_uint4(0, 0, 0, 0);
    if (patch_lane)
        patch = load_coherent_16B((lane < kChunks ? k_head : v_head) + newest * D + patch_chunk * kElemsPer16B);

    // Q as the A operand: row = query head within the group, column = dim.
    uint32_t qa[kKSteps][4];
    {
        const T* q_lo = q + b * p.q_batch_stride + (int64_t)(h * G + frag_row) * p.q_head_stride;
        const T* q_hi = q_lo + 8 * p.q_head_stride;
        const bool has_lo = frag_row < G, has_hi = frag_row + 8 < G;
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk) {
            const int c = 16 * kk + frag_col;
            qa[kk][0] = has_lo ? pack2<T>(to_float(q_lo[c]), to_float(q_lo[c + 1])) : 0u;
            qa[kk][1] = has_hi ? pack2<T>(to_float(q_hi[c]), to_float(q_hi[c + 1])) : 0u;
            qa[kk][2] = has_lo ? pack2<T>(to_float(q_lo[c + 8]), to_float(q_lo[c + 9])) : 0u;
            qa[kk][3] = has_hi ? pack2<T>(to_float(q_hi[c + 8]), to_float(q_hi[c + 9])) : 0u;
        }
    }

    float o[kDimTiles][4];
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows frag_row and frag_row + 8

    // ldmatrix.x4 address of this lane: matrices (rows 0-7 | 8-15) x (chunk c | c+1).
    const int ld_row = (lane & 7) + ((lane >> 3) & 1) * 8, ld_chunk = lane >> 4;

    for (int i = 0; i < my_steps; ++i) {
        cp_async_wait_pending(p.stages - 2);  // step i has landed (this lane's copies)
        if (i == patch_step && patch_lane) {
            T* row = ring + (i % p.stages) * kStageElems + (lane < kChunks ? 0 : kRows * D) + patch_row * D;
            *reinterpret_cast<uint4*>(row + (patch_chunk ^ (patch_row & 7)) * kElemsPer16B) = patch;
        }
        __syncwarp();                         // ... and every lane's; slot i-1 is free again
        if (i + p.stages - 1 < my_steps) issue(i + p.stages - 1, false);
        cp_async_commit();

        const T* k_slot = ring + (i % p.stages) * kStageElems;
        const T* v_slot = k_slot + kRows * D;
        const int64_t row0 = step_row(i);
        // Sparse: a row's positions count up to the newest, and only for the heads whose bit keeps the tile.
        int64_t last_row = end - 1;
        int head_bits = -1;
        if constexpr (kSparse) last_row = min(last_row, row0 + (newest - position(row0)));
        if constexpr (kMode == kListedTiles) head_bits = bits[row0 / kKeyTile];

        // S = Q K^T over 16 positions: n-tile 0 holds positions 0-7, n-tile 1 positions 8-15.
        float s[2][4] = {};
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk) {
            uint32_t kb[4];
            ldmatrix_x4(kb, smem_addr(k_slot + (ld_row * kChunks + ((2 * kk + ld_chunk) ^ (ld_row & 7))) * kElemsPer16B));
            mma_m16n8k16<T>(s[0], qa[kk], kb[0], kb[2]);
            mma_m16n8k16<T>(s[1], qa[kk], kb[1], kb[3]);
        }

        // Online softmax per query row; a row's 16 scores are spread over the 4 lanes of a quad.
        float pr[2][4];
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {  // hr = 0: row frag_row (elements 0, 1); 1: row + 8 (2, 3)
            float mx = -INFINITY;
            const bool head_keeps = (head_bits >> (frag_row + 8 * hr)) & 1;
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int64_t row = row0 + 8 * j + frag_col + e;
                    float& v = s[j][2 * hr + e];
                    v = row <= last_row && head_keeps ? v * p.scale_log2 : -INFINITY;
                    mx = fmaxf(mx, v);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m[hr], mx);
            const float base = m_new == -INFINITY ? 0.0f : m_new;  // nothing live in this row yet
            const float alpha = exp2f(m[hr] - base);
            m[hr] = m_new;
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    pr[j][2 * hr + e] = exp2f(s[j][2 * hr + e] - base);
                    sum += pr[j][2 * hr + e];
                }
            l[hr] = l[hr] * alpha + sum;
#pragma unroll
            for (int dt = 0; dt < kDimTiles; ++dt) {
                o[dt][2 * hr] *= alpha;
                o[dt][2 * hr + 1] *= alpha;
            }
        }

        // O += P V: S's accumulator layout is the A operand's (positions 0-7 then 8-15 along k).
        const uint32_t pa[4] = {pack2<T>(pr[0][0], pr[0][1]), pack2<T>(pr[0][2], pr[0][3]),
                                pack2<T>(pr[1][0], pr[1][1]), pack2<T>(pr[1][2], pr[1][3])};
#pragma unroll
        for (int dp = 0; dp < kDimTiles / 2; ++dp) {
            uint32_t vb[4];
            ldmatrix_x4_trans(vb, smem_addr(v_slot + (ld_row * kChunks + ((2 * dp + ld_chunk) ^ (ld_row & 7))) * kElemsPer16B));
            mma_m16n8k16<T>(o[2 * dp], pa, vb[0], vb[1]);
            mma_m16n8k16<T>(o[2 * dp + 1], pa, vb[2], vb[3]);
        }
    }
    cp_async_wait<0>();
    __syncwarp();

    // Each warp leaves its unnormalised O [16][D], row maxima m[16] and row sums l[16] in its ring.
    float* state = reinterpret_cast<float*>(ring);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 1);
        l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 2);
        const int row = frag_row + 8 * hr;
        if (row < G) {
#pragma unroll
            for (int dt = 0; dt < kDimTiles; ++dt) {
                state[row * D + 8 * dt + frag_col] = o[dt][2 * hr];
                state[row * D + 8 * dt + frag_col + 1] = o[dt][2 * hr + 1];
            }
            if (lane % 4 == 0) {
                state[16 * D + row] = m[hr];
                state[16 * D + 16 + row] = l[hr];
            }
        }
    }
    __syncthreads();

    const int q_heads = p.q_heads;
    int* counters = reinterpret_cast<int*>(workspace);
    float* part_o = workspace + (batch * p.kv_heads + 3) / 4 * 4;  // [B, Hq, splits, D]
    float* part_lse = part_o + (int64_t)batch * q_heads * splits * D;  // [B, Hq, splits]
    const int64_t warp_floats = (int64_t)p.stages * kStageElems * sizeof(T) / sizeof(float);
    const float* states = reinterpret_cast<const float*>(smem);

    // Merge the warps; a lone live split writes the output, others write their normalised partial.
    for (int idx = threadIdx.x; idx < G * D; idx += kThreads) {
        const int g = idx / D, d = idx % D;
        float mx = -INFINITY;
        for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, states[w * warp_floats + 16 * D + g]);
        // Sparse: a head whose bit keeps none of this block's tiles has nothing (-inf, weight 0).
        const float base = kSparse && mx == -INFINITY ? 0.0f : mx;
        float num = 0.0f, den = 0.0f;
        for (int w = 0; w < kWarps; ++w) {
            const float* st = states + w * warp_floats;
            const float f = exp2f(st[16 * D + g] - base);
            num += f * st[g * D + d];
            den += f * st[16 * D + 16 + g];
        }
        const float o_val = kSparse && den == 0.0f ? 0.0f : num / den;
        const int64_t hq = (int64_t)b * q_heads + h * G + g;
        if (n_live == 1) {
            out[hq * D + d] = from_float<T>(o_val);
        } else {
            part_o[(hq * splits + split) * D + d] = o_val;
            if (d == 0) part_lse[hq * splits + split] = mx + log2f(den);  // -inf when den is 0
        }
    }
    if (n_live == 1) return;

    // Publish the partial, then count arrivals; the last block of this KV head merges the splits.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) block_is_last = atomicAdd(&counters[b * p.kv_heads + h], 1) == n_live - 1;
    __syncthreads();
    if (!block_is_last) return;
    __threadfence();

    // One pass over the splits: each thread rescales its running sum as it meets a larger
    // log-sum-exp, so the partials and their weights come back in a single round of loads.
    for (int idx = threadIdx.x; idx < G * (D / 4); idx += kThreads) {
        const int g = idx / (D / 4), d4 = idx % (D / 4);
        const int64_t hq = (int64_t)b * q_heads + h * G + g;
        const float* lse = part_lse + hq * splits;
        const float4* src = reinterpret_cast<const float4*>(part_o + hq * splits * D) + d4;
        float mx = -INFINITY, sum = 0.0f;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int s0 = 0; s0 < n_live; s0 += kMergeBatch) {
            float lse_s[kMergeBatch];
            float4 part[kMergeBatch];
#pragma unroll
            for (int j = 0; j < kMergeBatch; ++j) {
                const bool live_split = s0 + j < n_live;
                lse_s[j] = live_split ? __ldcg(lse + s0 + j) : -INFINITY;
                part[j] = live_split ? __ldcg(src + (s0 + j) * (D / 4)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (int j = 0; j < kMergeBatch; ++j) {
                // Dense: finite, as split s0 is live; sparse: -inf while no split had this head's tiles.
                const float m_new = fmaxf(mx, lse_s[j]);
                const float m_base = kSparse && m_new == -INFINITY ? 0.0f : m_new;
                const float alpha = exp2f(mx - m_base), w = exp2f(lse_s[j] - m_base);
                acc.x = acc.x * alpha + w * part[j].x;
                acc.y = acc.y * alpha + w * part[j].y;
                acc.z = acc.z * alpha + w * part[j].z;
                acc.w = acc.w * alpha + w * part[j].w;
                sum = sum * alpha + w;
                mx = m_new;
            }
        }
        const float inv = kSparse && sum == 0.0f ? 0.0f : 1.0f / sum;
        T* dst = out + hq * D + 4 * d4;
        dst[0] = from_float<T>(acc.x * inv);
        dst[1] = from_float<T>(acc.y * inv);
        dst[2] = from_float<T>(acc.z * inv);
        dst[3] = from_float<T>(acc.w * inv);
    }
    if (threadIdx.x == 0) counters[b * p.kv_heads + h] = 0;  // at rest again for the next launch
}

template <typename T, int D, int kMode>
void launch_typed(const void* q, const void* k_cache, const void* v_cache, const int64_t* input_pos, void* out,
                  float* workspace, int batch, int splits, int stages, const AttnParams& base,
                  const DecodeKeptTiles& kept, cudaStream_t stream) {
    constexpr int kStageBytes = 2 * kRows * D * (int)sizeof(T);
    int device = 0, max_smem = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    AttnParams p = base;
    const int wanted = stages > 0 ? stages : kWarpRingBytes / kStageBytes;
    p.stages = std::max(2, std::min({wanted, kMaxStages, max_smem / (kWarps * kStageBytes)}));
    const int smem = kWarps * p.stages * kStageBytes;
    const auto kernel = decode_attention_kernel<T, D, kMode>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    launch_with_pdl(kernel, dim3(splits, p.kv_heads, batch), dim3(kThreads), smem, stream, true,
                    static_cast<const T*>(q), static_cast<const T*>(k_cache), static_cast<const T*>(v_cache),
                    input_pos, static_cast<T*>(out), workspace, p, kept);
}

template <typename T>
void launch_dim(int64_t head_dim, const void* q, const void* k_cache, const void* v_cache, const int64_t* input_pos,
                void* out, float* workspace, int batch, int splits, int stages, const AttnParams& p,
                const DecodeKeptTiles* kept, cudaStream_t stream) {
    const DecodeKeptTiles tiles = kept ? *kept : DecodeKeptTiles{};
    const auto launch = [&](auto dim, auto mode) {
        launch_typed<T, decltype(dim)::value, decltype(mode)::value>(q, k_cache, v_cache, input_pos, out, workspace,
                                                                     batch, splits, stages, p, tiles, stream);
    };
    const auto with_mode = [&](auto dim) {
        if (!kept)
            launch(dim, std::integral_constant<int, kDense>{});
        else if (kept->tile_ptr)
            launch(dim, std::integral_constant<int, kListedTiles>{});
        else
            launch(dim, std::integral_constant<int, kSinkWindow>{});
    };
    if (head_dim == 64)
        with_mode(std::integral_constant<int, 64>{});
    else
        with_mode(std::integral_constant<int, 128>{});
}

}  // namespace

void launch_decode_attention(const void* q, int64_t q_batch_stride, int64_t q_head_stride, const void* k_cache,
                             const void* v_cache, const int64_t* input_pos, float scale, void* out, float* workspace,
                             int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                             int64_t max_seq_len, int splits, int stages, DType dtype, cudaStream_t stream,
                             const DecodeKeptTiles* kept) {
    if (batch == 0) return;
    const AttnParams p{q_batch_stride, q_head_stride, max_seq_len, (int)q_heads, (int)kv_heads,
                       (int)(q_heads / kv_heads), 0, scale * kLog2e};
    if (dtype == DType::kBFloat16)
        launch_dim<__nv_bfloat16>(head_dim, q, k_cache, v_cache, input_pos, out, workspace, (int)batch, splits,
                                  stages, p, kept, stream);
    else
        launch_dim<half>(head_dim, q, k_cache, v_cache, input_pos, out, workspace, (int)batch, splits, stages, p,
                         kept, stream);
}

}  // namespace minfer
