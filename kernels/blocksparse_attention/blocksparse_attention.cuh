// Block-sparse flash attention (prefill) on tensor cores. Framework-free; included by blocksparse_attention.cu.
//
// A block takes a pair of 64-token query tiles (128 rows) of one head. The two tiles' ascending key-tile
// lists are merged on the fly, so a key tile both keep is loaded once for 128 rows (every tile of a
// block-128 layout, most tiles of a dense one); the warps of a tile skip the key tiles its list lacks.
// K/V tiles are double-buffered with cp.async: tile n+1 is in flight while tile n is computed. Online
// softmax in base 2 with fp32 statistics and accumulators; the causal mask applies on the diagonal tile.
// Shared tiles are stored in 64-column panels with the 128-byte swizzle, which keeps ldmatrix free of
// bank conflicts and is the canonical layout wgmma reads.
//
// Two kernels share that skeleton:
// - wgmma (sm_90a): 2 warpgroups, one per query tile, two blocks per SM; S = Q K^T with both operands
//   in shared memory, O += P V with P from registers and V read N-major (no transpose pass);
// - mma.sync m16n8k16 (sm_80+): 4 warps of 32 rows, fragments through ldmatrix.
#pragma once
#include "blocksparse_attention.h"
#include "common/device_utils.cuh"
#include "common/sm90_pipeline.cuh"
#include "wgmma_ops.cuh"

#include <climits>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MINFER_BLOCKSPARSE_WGMMA 1
#endif

namespace minfer {
namespace blocksparse {

constexpr int kTile = kBlocksparseTile;
constexpr int kQueryRows = 2 * kTile;   // a block's two query tiles
constexpr int kKeyTiles = kTile / 8;    // n8 tiles of S per key tile
constexpr int kSmemAlign = 1024;        // a 128-byte swizzle pattern repeats every 1024 bytes

// Depth of the K/V ring. Both kernels fit two blocks per SM with 2 stages (97 KB at D 128); a wgmma
// shape with one block per SM and 3 stages ran 18% slower (docs/perf-notes.md).
constexpr int kStages = 2;

// Shared memory of a kernel: Q (128 rows), then kStages stages of K and V (64 rows each).
template <typename T, int D>
constexpr int smem_bytes() {
    return kSmemAlign + (kQueryRows + kStages * 2 * kTile) * D * (int)sizeof(T);
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

struct Params {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    const int* tile_ptr;
    const int* key_tiles;
    AttnStrides q_strides, k_strides, v_strides, out_strides;
    int batch, seq_len, q_tiles, q_heads, kv_heads, layout_heads;
    float scale_log2;  // softmax scale * log2(e)
};

// Element offset of 16-byte chunk `chunk` of row `row` in a tile of kRows rows: 64-column panels of
// kRows x 128 bytes, chunk c of a row at c ^ (row % 8) within its panel.
template <int kRows>
__device__ __forceinline__ int swizzled(int row, int chunk) {
    return (chunk / 8) * kRows * 64 + row * 64 + (((chunk % 8) ^ (row & 7)) * 8);
}

// Copies kRows rows (row `first` on, `row_stride` elements apart) into a swizzled tile; rows at or
// past seq_len are zero-filled, never read.
template <typename T, int D, int kRows, int kThreads>
__device__ __forceinline__ void load_tile(T* tile, const T* src, int64_t row_stride, int first, int seq_len) {
    constexpr int kChunks = D / 8;
#pragma unroll
    for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
        const int r = i / kChunks, c = i % kChunks;
        const bool valid = first + r < seq_len;
        const T* from = src + (valid ? (int64_t)(first + r) * row_stride : 0) + c * 8;
        cp_async_16(smem_addr(tile + swizzled<kRows>(r, c)), from, valid);
    }
}

// The two query tiles' key-tile lists, merged: each step yields the next key tile in ascending order
// and which tiles keep it (bit 0: the first, bit 1: the second).
// Lane 0's value: the same in every lane, and known to the compiler to be, so that wgmma code under
// branches on it is not serialized (ptxas C7520).
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

struct MergedLists {
    const int* key_tiles;
    int a, a_end, b, b_end;

    __device__ bool done() const { return a >= a_end && b >= b_end; }

    __device__ MergedLists warp_uniform_copy() const {
        return {key_tiles, warp_uniform(a), warp_uniform(a_end), warp_uniform(b), warp_uniform(b_end)};
    }

    // kUniform: the loaded tiles pass through warp_uniform (a copy from warp_uniform_copy stays uniform).
    template <bool kUniform = false>
    __device__ int pop(int& keepers) {
        int ka = a < a_end ? key_tiles[a] : INT_MAX;
        int kb = b < b_end ? key_tiles[b] : INT_MAX;
        if constexpr (kUniform) {
            ka = warp_uniform(ka);
            kb = warp_uniform(kb);
        }
        const int k = min(ka, kb);
        keepers = (ka == k ? 1 : 0) | (kb == k ? 2 : 0);
        a += ka == k;
        b += kb == k;
        return k;
    }
};

// One work item: a pair of query tiles of one head, that head's pointers and coordinates, and the
// pair's merged lists.
template <typename T>
struct PairTask {
    const T* q;
    const T* k;
    const T* v;
    T* out;
    int first;  // the first query tile; the second is first + 1 when it exists
    int head, kv_head, batch;
    MergedLists lists;

    __device__ PairTask(const Params& p, int pair, int h, int b) : head(h), batch(b) {
        kv_head = h / (p.q_heads / p.kv_heads);
        q = static_cast<const T*>(p.q) + b * p.q_strides.batch + h * p.q_strides.head;
        k = static_cast<const T*>(p.k) + b * p.k_strides.batch + kv_head * p.k_strides.head;
        v = static_cast<const T*>(p.v) + b * p.v_strides.batch + kv_head * p.v_strides.head;
        out = static_cast<T*>(p.out) + b * p.out_strides.batch + h * p.out_strides.head;
        first = 2 * pair;
        const int* lists_of_head = p.tile_ptr + (p.layout_heads == 1 ? 0 : h) * p.q_tiles;
        const bool has_second = first + 1 < p.q_tiles;  // an odd tile count leaves the last pair one tile
        lists = {p.key_tiles, lists_of_head[first], lists_of_head[first + 1],
                 has_second ? lists_of_head[first + 1] : 0, has_second ? lists_of_head[first + 2] : 0};
    }
};

// The pair of a block of the one-pair-per-block grid (x: pairs, y: heads, z: batch).
template <typename T>
__device__ PairTask<T> block_pair(const Params& p) {
    return PairTask<T>(p, gridDim.x - 1 - blockIdx.x, blockIdx.y, blockIdx.z);  // causal lists grow: longest first
}

// Loads Q, then calls compute(key_tile, keepers, k_tile, v_tile) for each merged key tile with that
// tile's K and V resident in shared memory and the next kStages - 1 tiles in flight (a ring of
// kStages; one cp.async group per tile, Q in the first). Two cursors walk the same merged lists: one
// issues loads ahead, one follows with the computation. kAsyncProxy: the tiles are read by wgmma (the
// async proxy), so each thread fences its copies before the barrier.
template <typename T, int D, int kThreads, bool kAsyncProxy, typename Compute>
__device__ __forceinline__ void visit_kept_tiles(const Params& p, PairTask<T>& task, T* q_smem, T* kv_smem,
                                                 Compute&& compute) {
    if (task.lists.done()) return;
    MergedLists loads = task.lists, computes = task.lists;
    auto issue_next = [&](int stage) {
        if (!loads.done()) {
            int keepers;
            const int key_tile = loads.pop(keepers);
            T* k_tile = kv_smem + stage * 2 * kTile * D;
            load_tile<T, D, kTile, kThreads>(k_tile, task.k, p.k_strides.seq, key_tile * kTile, p.seq_len);
            load_tile<T, D, kTile, kThreads>(k_tile + kTile * D, task.v, p.v_strides.seq, key_tile * kTile,
                                             p.seq_len);
        }
        cp_async_commit();  // empty past the end: the group count per tile stays fixed
    };
    load_tile<T, D, kQueryRows, kThreads>(q_smem, task.q, p.q_strides.seq, task.first * kTile, p.seq_len);
#pragma unroll
    for (int stage = 0; stage < kStages - 1; ++stage) issue_next(stage);
    for (int n = 0;; ++n) {
        issue_next((n + kStages - 1) % kStages);  // the stage tile n - 1 used
        cp_async_wait<kStages - 1>();             // tile n (group n) has landed
        if constexpr (kAsyncProxy) fence_proxy_async_shared();
        __syncthreads();
        int keepers;
        const int key_tile = computes.pop(keepers);
        const T* k_tile = kv_smem + (n % kStages) * 2 * kTile * D;
        compute(key_tile, keepers, k_tile, k_tile + kTile * D);
        __syncthreads();  // a later issue overwrites this stage
        if (computes.done()) break;
    }
}

// One warp's online-softmax step over a key tile for kM m16 row tiles: s holds Q K^T (each thread rows
// lane/4 and lane/4 + 8 of each m-tile, the quad's four lanes share a row) and becomes the tile's
// probabilities; the statistics advance and alpha gets each row's factor for O (rescale_rows).
// `row0`: the tile row of the warp's first row. Key j of the tile is visible to query i when
// j <= i + reach: kTile for a full tile, 0 on the diagonal (every row still sees its own key), -kTile
// for none (the row's statistics and O stay as they were).
constexpr int kReachAll = kTile, kReachCausal = 0, kReachNone = -kTile;

template <int kM>
__device__ __forceinline__ void softmax_scores(float (&s)[kM][kKeyTiles][4], float (&row_max)[kM][2],
                                               float (&row_sum)[kM][2], float (&alpha)[kM][2], float scale_log2,
                                               int reach, int row0, int lane) {
    if (reach < kReachAll) {
#pragma unroll
        for (int mt = 0; mt < kM; ++mt)
#pragma unroll
            for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = row0 + mt * 16 + lane / 4 + 8 * (e / 2);
                    const int col = nt * 8 + 2 * (lane % 4) + e % 2;
                    if (col > row + reach) s[mt][nt][e] = -INFINITY;
                }
    }
#pragma unroll
    for (int mt = 0; mt < kM; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float mx = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < kKeyTiles; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hr], s[mt][nt][2 * hr + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(row_max[mt][hr], mx * scale_log2);
            const float base = m_new == -INFINITY ? 0.0f : m_new;  // no key seen yet: everything stays 0
            alpha[mt][hr] = fast_exp2(row_max[mt][hr] - base);
            row_max[mt][hr] = m_new;
            float sum = 0.0f;
#pragma unroll
            for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
                for (int e = 2 * hr; e < 2 * hr + 2; ++e) {
                    s[mt][nt][e] = fast_exp2(s[mt][nt][e] * scale_log2 - base);
                    sum += s[mt][nt][e];
                }
            row_sum[mt][hr] = row_sum[mt][hr] * alpha[mt][hr] + sum;
        }
}

// O's rows times their softmax_scores factors.
template <int kM, int kDimTiles>
__device__ __forceinline__ void rescale_rows(float (&o)[kM][kDimTiles][4], const float (&alpha)[kM][2]) {
#pragma unroll
    for (int mt = 0; mt < kM; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
            if (__any_sync(0xffffffffu, alpha[mt][hr] != 1.0f)) {  // no row of the warp has a new maximum: O stays
#pragma unroll
                for (int dt = 0; dt < kDimTiles; ++dt) {
                    o[mt][dt][2 * hr] *= alpha[mt][hr];
                    o[mt][dt][2 * hr + 1] *= alpha[mt][hr];
                }
            }
}

template <int kM, int kDimTiles>
__device__ __forceinline__ void softmax_step(float (&s)[kM][kKeyTiles][4], float (&o)[kM][kDimTiles][4],
                                             float (&row_max)[kM][2], float (&row_sum)[kM][2], float scale_log2,
                                             bool diagonal, int row0, int lane) {
    float alpha[kM][2];
    softmax_scores(s, row_max, row_sum, alpha, scale_log2, diagonal ? kReachCausal : kReachAll, row0, lane);
    rescale_rows(o, alpha);
}

// P for k-step ks (keys 16 ks .. 16 ks + 15) of m-tile mt as an A operand: S's accumulator layout
// of n8 tiles 2 ks and 2 ks + 1 is the m16n8k16 (and wgmma register) A fragment.
template <typename T, int kM>
__device__ __forceinline__ void probabilities_as_a(uint32_t (&a)[4], const float (&s)[kM][kKeyTiles][4], int mt,
                                                   int ks) {
    a[0] = pack2<T>(s[mt][2 * ks][0], s[mt][2 * ks][1]);
    a[1] = pack2<T>(s[mt][2 * ks][2], s[mt][2 * ks][3]);
    a[2] = pack2<T>(s[mt][2 * ks + 1][0], s[mt][2 * ks + 1][1]);
    a[3] = pack2<T>(s[mt][2 * ks + 1][2], s[mt][2 * ks + 1][3]);
}

// Epilogue of one warp: O / row sum (zeros for rows that kept no key tile), staged through the warp's
// own rows of a swizzled tile of kRows rows (Q's, once no longer read, or a staging tile) so that global
// stores are 16 bytes wide. `smem_row0`: the warp's first row in that tile; `out_row0`: its sequence position.
template <typename T, int D, int kM, int kRows>
__device__ __forceinline__ void store_rows(const float (&o)[kM][D / 8][4], const float (&row_sum)[kM][2],
                                           T* stage, int smem_row0, T* out, int64_t out_stride, int out_row0,
                                           int seq_len, int lane) {
    constexpr int kChunks = D / 8;
    __syncwarp();  // every lane's reads of an earlier use of these rows are done
#pragma unroll
    for (int mt = 0; mt < kM; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float sum = row_sum[mt][hr];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            const int row = smem_row0 + mt * 16 + lane / 4 + 8 * hr;
#pragma unroll
            for (int dt = 0; dt < kChunks; ++dt)
                *reinterpret_cast<uint32_t*>(stage + swizzled<kRows>(row, dt) + 2 * (lane % 4)) =
                    pack2<T>(o[mt][dt][2 * hr] * inv, o[mt][dt][2 * hr + 1] * inv);
        }
    __syncwarp();
#pragma unroll
    for (int i = lane; i < kM * 16 * kChunks; i += 32) {
        const int r = i / kChunks, c = i % kChunks;
        if (out_row0 + r < seq_len)
            *reinterpret_cast<uint4*>(out + (int64_t)(out_row0 + r) * out_stride + c * 8) =
                *reinterpret_cast<const uint4*>(stage + swizzled<kRows>(smem_row0 + r, c));
    }
}

template <typename T>
__device__ __forceinline__ T* aligned_smem(unsigned char* raw) {
    return reinterpret_cast<T*>(raw + ((kSmemAlign - smem_addr(raw) % kSmemAlign) % kSmemAlign));
}

// ---- mma.sync kernel: 4 warps, 32 rows (two m16 tiles) each; warps 0-1 the first query tile ----

constexpr int kMmaThreads = 128;

template <typename T, int D>
__global__ void __launch_bounds__(kMmaThreads, 2) prefill_mma_kernel(const Params p) {
    constexpr int kDimSteps = D / 16;  // k-steps of S = Q K^T
    constexpr int kDimTiles = D / 8;   // n-tiles of O = P V
    extern __shared__ unsigned char smem_raw[];
    T* q_smem = aligned_smem<T>(smem_raw);
    T* kv_smem = q_smem + kQueryRows * D;

    PairTask<T> task = block_pair<T>(p);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int half = warp / 2;                 // which of the two query tiles this warp computes
    const int tile_row0 = (warp % 2) * 32;     // the warp's first row inside its tile
    const int block_row0 = half * kTile + tile_row0;

    float o[2][kDimTiles][4] = {};
    float row_max[2][2], row_sum[2][2] = {};
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) row_max[mt][0] = row_max[mt][1] = -INFINITY;

    visit_kept_tiles<T, D, kMmaThreads, false>(p, task, q_smem, kv_smem, [&](int key_tile, int keepers,
                                                                                const T* k_tile, const T* v_tile) {
        if (!((keepers >> half) & 1)) return;
        float s[2][kKeyTiles][4] = {};
#pragma unroll
        for (int kk = 0; kk < kDimSteps; ++kk) {
            uint32_t qa[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
                ldmatrix_x4(qa[mt], smem_addr(q_smem + swizzled<kQueryRows>(block_row0 + mt * 16 + lane % 16,
                                                                            2 * kk + lane / 16)));
#pragma unroll
            for (int np = 0; np < kKeyTiles / 2; ++np) {
                uint32_t kb[4];
                ldmatrix_x4(kb, smem_addr(k_tile + swizzled<kTile>(np * 16 + lane % 8 + 8 * (lane / 16),
                                                                  2 * kk + (lane / 8) % 2)));
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mma_m16n8k16<T>(s[mt][2 * np], qa[mt], kb[0], kb[1]);
                    mma_m16n8k16<T>(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
                }
            }
        }
        softmax_step(s, o, row_max, row_sum, p.scale_log2, key_tile == task.first + half, tile_row0, lane);
#pragma unroll
        for (int ks = 0; ks < kTile / 16; ++ks) {
            uint32_t pa[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) probabilities_as_a<T>(pa[mt], s, mt, ks);
#pragma unroll
            for (int dp = 0; dp < kDimTiles / 2; ++dp) {
                uint32_t vb[4];
                ldmatrix_x4_trans(vb, smem_addr(v_tile + swizzled<kTile>(ks * 16 + lane % 8 + 8 * ((lane / 8) % 2),
                                                                              2 * dp + lane / 16)));
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mma_m16n8k16<T>(o[mt][2 * dp], pa[mt], vb[0], vb[1]);
                    mma_m16n8k16<T>(o[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
                }
            }
        }
    });
    __syncthreads();  // every warp is done with Q before any stages its output there
    store_rows<T, D, 2, kQueryRows>(o, row_sum, q_smem, block_row0, task.out, p.out_strides.seq,
                        task.first * kTile + block_row0, p.seq_len, lane);
}

// ---- wgmma kernel: 2 warpgroups, warpgroup g computes query tile first + g; warp w of it rows 16 w.. ----

constexpr int kWgmmaThreads = 256;

// Two blocks per SM: registers capped at 128 (a few bytes spill at D 128), so that the warpgroups of
// one block, held in step by its barriers, interleave with the other block's.
template <typename T, int D>
__global__ void __launch_bounds__(kWgmmaThreads, 2) prefill_wgmma_kernel(const Params p) {
#ifdef MINFER_BLOCKSPARSE_WGMMA
    constexpr int kDimTiles = D / 8;
    constexpr uint32_t kRowBytes = 128;  // one panel row
    extern __shared__ unsigned char smem_raw[];
    T* q_smem = aligned_smem<T>(smem_raw);
    T* kv_smem = q_smem + kQueryRows * D;

    PairTask<T> task = block_pair<T>(p);
    const int group = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int tile_row0 = warp * 16;
    const uint32_t q_rows = smem_addr(q_smem) + group * kTile * kRowBytes;  // this warpgroup's 64 rows

    float o[1][kDimTiles][4] = {};
    float row_max[1][2] = {{-INFINITY, -INFINITY}}, row_sum[1][2] = {};
    auto& o_flat = reinterpret_cast<float(&)[D / 2]>(o);

    visit_kept_tiles<T, D, kWgmmaThreads, true>(p, task, q_smem, kv_smem, [&](int key_tile, int keepers,
                                                                                      const T* k_tile,
                                                                                      const T* v_tile) {
        if (!((keepers >> group) & 1)) return;
        float s[1][kKeyTiles][4];
        auto& s_flat = reinterpret_cast<float(&)[32]>(s);
        const uint32_t k_addr = smem_addr(k_tile), v_addr = smem_addr(v_tile);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {  // 16 dims: panel kk / 4, (kk % 4) * 32 bytes into its rows
            const uint32_t panel = kk / 4, in_row = (kk % 4) * 32;
            wgmma_m64n64k16_ss<T>(s_flat, k_major_descriptor(q_rows + panel * kQueryRows * kRowBytes + in_row),
                                  k_major_descriptor(k_addr + panel * kTile * kRowBytes + in_row), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_accumulators(s_flat);
        fence_accumulators(o_flat);
        softmax_step(s, o, row_max, row_sum, p.scale_log2, key_tile == task.first + group, tile_row0, lane);
        uint32_t pa[kTile / 16][4];
#pragma unroll
        for (int ks = 0; ks < kTile / 16; ++ks) probabilities_as_a<T, 1>(pa[ks], s, 0, ks);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kTile / 16; ++ks) {  // 16 keys: rows 16 ks.. of every panel
            const uint64_t v_desc = panel_descriptor(v_addr + ks * 16 * kRowBytes, kTile * kRowBytes);
            if constexpr (D == 128)
                wgmma_m64n128k16_rs<T>(o_flat, pa[ks], v_desc);
            else
                wgmma_m64n64k16_rs<T>(o_flat, pa[ks], v_desc);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_accumulators(o_flat);
    });
    __syncthreads();  // every warpgroup's wgmma reads of Q are done before any warp stages its output there
    store_rows<T, D, 1, kQueryRows>(o, row_sum, q_smem, group * kTile + tile_row0, task.out, p.out_strides.seq,
                        (task.first + group) * kTile + tile_row0, p.seq_len, lane);
#else
    __trap();  // built without sm_90a: the launcher never picks this kernel
#endif
}

// ---- warp-specialized wgmma kernel (the FlashAttention-3 schedule) ----
// Warpgroup 0 is the producer: one thread walks the pairs' merged lists and issues TMA loads of Q and
// of the K/V tiles into a ring of kWsStages, each stage handed over through mbarriers (K and V landed
// apart; `empty` when both consumers are done). Warpgroups 1 and 2 are the consumers, one per query
// tile, with no block-wide barrier between them. Each computes every merged tile (one its tile does
// not keep is fully masked), so that every step issues the same wgmmas: S_j = Q K_j^T, then O (scaled
// by tile j-1's factors) += P_{j-1} V_{j-1}, and tile j's softmax follows while P V may be in flight
// (in the SASS ptxas moves the P V wait ahead of the exponentials: only the masking overlaps it).
// A wgmma under a data-dependent branch, or a branch whose condition the compiler cannot prove
// warp-uniform, makes ptxas serialize every wgmma of the kernel (C7520/C7514); hence the peeled first
// and last steps and the warp_uniform lists. kPingPong: the two consumers take turns issuing their
// wgmmas (named barriers), so one's softmax runs while the other's matrix products do. The grid is
// persistent or one pair per block (the launcher's choice): a block takes items blockIdx.x,
// blockIdx.x + gridDim.x, .. (ordered in task_of), and the producer loads the next item's Q and tiles
// while the consumers finish the last one.

constexpr int kWsThreads = 384;
constexpr int kWsStages = 4;
constexpr int kTurnBarrier = 1;  // named barriers 1 and 2: consumer g's turn to issue
constexpr int kHeadsPerGroup = 2;  // as many heads as run at once in the one-pair-per-block grid at 16k

// Shared memory of the warp-specialized kernel in bytes from the aligned base: Q (one 64-row tile per
// consumer), each consumer's output staging tile, the ring, then the barriers.
template <int D>
struct WsSmem {
    static constexpr int kTileBytes = kTile * D * 2;  // D / 64 panels of 64 rows x 128 bytes
    static constexpr int kQ = 0;
    static constexpr int kOut = 2 * kTileBytes;
    static constexpr int kRing = 4 * kTileBytes;      // stage s: K tile, then V tile
    static constexpr int kBarriers = kRing + kWsStages * 2 * kTileBytes;
    // q_full, q_empty, then per stage k_full, v_full, empty
    static constexpr int kBytes = kSmemAlign + kBarriers + (2 + 3 * kWsStages) * 8;
};

template <typename T, int D, bool kPingPong>
__global__ void __launch_bounds__(kWsThreads, 1)
    prefill_ws_kernel(const Params p, const __grid_constant__ CUtensorMap map_q,
                      const __grid_constant__ CUtensorMap map_k, const __grid_constant__ CUtensorMap map_v) {
#ifdef MINFER_BLOCKSPARSE_WGMMA
    using L = WsSmem<D>;
    constexpr int kDimTiles = D / 8;
    constexpr int kPanels = D / 64;
    constexpr uint32_t kRowBytes = 128;     // one panel row
    constexpr uint32_t kPanelBytes = kTile * kRowBytes;
    extern __shared__ unsigned char smem_raw[];
    T* smem = aligned_smem<T>(smem_raw);
    const uint32_t base = smem_addr(smem);
    const uint32_t q_full = base + L::kBarriers, q_empty = q_full + 8;
    auto k_full = [&](int stage) { return q_full + 16 + 24 * stage; };
    auto v_full = [&](int stage) { return q_full + 24 + 24 * stage; };
    auto empty = [&](int stage) { return q_full + 32 + 24 * stage; };
    auto stage_addr = [&](int stage) { return base + L::kRing + stage * 2 * L::kTileBytes; };

    // Items: heads (of all batches) in groups of kHeadsPerGroup, each group's pairs longest lists first,
    // the group's heads within a pair; a group's K and V stay in L2 while its pairs run.
    const int pairs = (p.q_tiles + 1) / 2, heads = p.q_heads * p.batch;
    const int items = pairs * heads;
    auto task_of = [&](int item) {
        const int group = item / (pairs * kHeadsPerGroup), rest = item - group * pairs * kHeadsPerGroup;
        const int in_group = min(kHeadsPerGroup, heads - group * kHeadsPerGroup);  // the last may be short
        const int head = group * kHeadsPerGroup + rest % in_group;
        return PairTask<T>(p, pairs - 1 - rest / in_group, head % p.q_heads, head / p.q_heads);
    };

    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        mbar_init(q_empty, 8);  // one arrival per consumer warp
        for (int stage = 0; stage < kWsStages; ++stage) {
            mbar_init(k_full(stage), 1);
            mbar_init(v_full(stage), 1);
            mbar_init(empty(stage), 8);
        }
        fence_mbarrier_init();
    }
    __syncthreads();

    if (threadIdx.x / 128 == 0) {
        setmaxnreg_dec<40>();
        if (threadIdx.x != 0) return;
        int it = 0;  // key tiles loaded so far: stage it % kWsStages, ring pass it / kWsStages
        int round = 0;
        for (int item = blockIdx.x; item < items; item += gridDim.x, ++round) {
            PairTask<T> task = task_of(item);
            mbar_wait(q_empty, (round & 1) ^ 1);
            const int q_count = task.first + 1 < p.q_tiles ? 2 : 1;  // a last tile past the sequence is not read
            mbar_arrive_expect_tx(q_full, q_count * L::kTileBytes);   // rows past the sequence load as zeros
            for (int g = 0; g < q_count; ++g)
#pragma unroll
                for (int panel = 0; panel < kPanels; ++panel)
                    tma_load_4d(base + L::kQ + g * L::kTileBytes + panel * kPanelBytes, &map_q, panel * 64,
                                (task.first + g) * kTile, task.head, task.batch, q_full);
            MergedLists loads = task.lists;
            for (; !loads.done(); ++it) {
                int keepers;
                const int key_tile = loads.pop(keepers);
                const int stage = it % kWsStages;
                mbar_wait(empty(stage), ((it / kWsStages) & 1) ^ 1);
                const uint32_t k_tile = stage_addr(stage), v_tile = k_tile + L::kTileBytes;
                mbar_arrive_expect_tx(k_full(stage), L::kTileBytes);
#pragma unroll
                for (int panel = 0; panel < kPanels; ++panel)
                    tma_load_4d(k_tile + panel * kPanelBytes, &map_k, panel * 64, key_tile * kTile, task.kv_head,
                                task.batch, k_full(stage));
                mbar_arrive_expect_tx(v_full(stage), L::kTileBytes);
#pragma unroll
                for (int panel = 0; panel < kPanels; ++panel)
                    tma_load_4d(v_tile + panel * kPanelBytes, &map_v, panel * 64, key_tile * kTile, task.kv_head,
                                task.batch, v_full(stage));
            }
        }
    } else {
        setmaxnreg_inc<232>();
        const int g = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0) - 1;  // query tile first + g
        const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
        const int tile_row0 = warp * 16;
        const uint32_t q_tile = base + L::kQ + g * L::kTileBytes;
        T* out_stage = smem + (L::kOut + g * L::kTileBytes) / (int)sizeof(T);
        auto release = [&](uint32_t bar) {
            if (lane == 0) mbar_arrive(bar);
        };
        auto my_turn = [&] {
            if constexpr (kPingPong) named_barrier_sync(kTurnBarrier + g, 256);
        };
        auto their_turn = [&] {
            if constexpr (kPingPong) named_barrier_arrive(kTurnBarrier + 1 - g, 256);
        };
        if (g == 1) their_turn();  // consumer 0 issues first

        int it = 0, round = 0;
        for (int item = blockIdx.x; item < items; item += gridDim.x, ++round) {
            PairTask<T> task = task_of(item);
            float o[1][kDimTiles][4] = {};
            float row_max[1][2] = {{-INFINITY, -INFINITY}}, row_sum[1][2] = {};
            float s[1][kKeyTiles][4];
            uint32_t pa[kTile / 16][4];
            auto& o_flat = reinterpret_cast<float(&)[D / 2]>(o);
            auto& s_flat = reinterpret_cast<float(&)[32]>(s);
            auto& pa_flat = reinterpret_cast<uint32_t(&)[kTile / 4]>(pa);
            // Every merged tile is computed, a tile this query tile does not keep fully masked, so that
            // each step issues the same wgmmas (no wgmma under a branch) and holds at most two stages.
            MergedLists walk = task.lists.warp_uniform_copy();
            int stage = 0, pending = 0;  // the stage of this step's K, of the P V still to issue
            uint32_t phase = 0, pending_phase = 0;
            bool kept = false, diagonal = false;
            auto next_tile = [&] {  // the next merged tile: its stage, once its K has landed
                int keepers;
                const int key_tile = walk.pop<true>(keepers);
                kept = (keepers >> g) & 1;
                diagonal = key_tile == task.first + g;
                stage = it % kWsStages;
                phase = (it / kWsStages) & 1;
                ++it;
                mbar_wait(k_full(stage), phase);
            };
            auto issue_s = [&] {  // S = Q K^T of this step's stage
                const uint32_t k_addr = stage_addr(stage);
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {  // 16 dims: panel kk / 4, (kk % 4) * 32 bytes into its rows
                    const uint32_t panel = kk / 4, in_row = (kk % 4) * 32;
                    wgmma_m64n64k16_ss<T>(s_flat, k_major_descriptor(q_tile + panel * kPanelBytes + in_row),
                                          k_major_descriptor(k_addr + panel * kPanelBytes + in_row), kk > 0);
                }
                wgmma_commit();
            };
            auto issue_pv = [&] {  // O += P V of the pending stage (its V landed: v_full waited)
                const uint32_t v_addr = stage_addr(pending) + L::kTileBytes;
#pragma unroll
                for (int ks = 0; ks < kTile / 16; ++ks) {  // 16 keys: rows 16 ks.. of every panel
                    const uint64_t v_desc = panel_descriptor(v_addr + ks * 16 * kRowBytes, kPanelBytes);
                    if constexpr (D == 128)
                        wgmma_m64n128k16_rs<T>(o_flat, pa[ks], v_desc);
                    else
                        wgmma_m64n64k16_rs<T>(o_flat, pa[ks], v_desc);
                }
                wgmma_commit();
            };
            auto retire_pv = [&] {  // after the wait that covers it: O and P are free, the stage goes back
                fence_accumulators(o_flat);
                fence_operands(pa_flat);
                release(empty(pending));
            };
            auto probabilities = [&](float (&alpha)[1][2]) {  // S (landed) -> P in s, statistics, alpha
                fence_accumulators(s_flat);
                const int reach = !kept ? kReachNone : diagonal ? kReachCausal : kReachAll;
                softmax_scores(s, row_max, row_sum, alpha, p.scale_log2, reach, tile_row0, lane);
            };
            auto pack_pending = [&] {  // this step's P becomes the pending P V
#pragma unroll
                for (int ks = 0; ks < kTile / 16; ++ks) probabilities_as_a<T, 1>(pa[ks], s, 0, ks);
                pending = stage;
                pending_phase = phase;
            };
            mbar_wait(q_full, round & 1);
            if (!walk.done()) {
                float alpha[1][2];  // the pending tile's factors for O, applied just before its P V
                next_tile();        // the first tile: no P V before it
                my_turn();
                wgmma_fence();
                issue_s();
                their_turn();
                wgmma_wait<0>();
                probabilities(alpha);
                pack_pending();
                while (!walk.done()) {
                    next_tile();
                    mbar_wait(v_full(pending), pending_phase);  // long landed: no spin between the wgmmas
                    my_turn();
                    wgmma_fence();
                    issue_s();
                    rescale_rows(o, alpha);  // O is not in flight here; P V follows
                    wgmma_fence();
                    issue_pv();
                    their_turn();
                    wgmma_wait<1>();  // S is in; P V may still run during the softmax
                    probabilities(alpha);
                    wgmma_wait<0>();
                    retire_pv();
                    pack_pending();
                }
                mbar_wait(v_full(pending), pending_phase);
                rescale_rows(o, alpha);
                wgmma_fence();
                issue_pv();
                wgmma_wait<0>();
                retire_pv();
            }
            release(q_empty);  // every Q K^T of this item has completed
            store_rows<T, D, 1, kTile>(o, row_sum, out_stage, tile_row0, task.out, p.out_strides.seq,
                                       (task.first + g) * kTile + tile_row0, p.seq_len, lane);
        }
        if (g == 0) my_turn();  // consumer 1's last hand-over: no barrier arrival outlives the block
    }
#else
    __trap();  // built without sm_90a: the launcher never picks this kernel
#endif
}

}  // namespace blocksparse
}  // namespace minfer
