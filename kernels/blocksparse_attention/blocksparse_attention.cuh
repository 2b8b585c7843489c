// Block-sparse flash attention (prefill) on tensor cores: mma.sync m16n8k16, ldmatrix, cp.async.
// Framework-free; included by blocksparse_attention.cu only.
//
// One block of 4 warps takes a pair of 64-token query tiles (128 rows) of one head: warps 0-1 the
// first tile, warps 2-3 the second, 32 rows (two m16 tiles) each. The two tiles' ascending key-tile
// lists are merged on the fly, so a key tile both keep is loaded once for 128 rows (every tile of a
// block-128 layout, most tiles of a dense one); a warp skips the tiles its own list lacks. K/V tiles
// are double-buffered: tile n+1 is in flight while tile n is computed. Online softmax in base 2 with
// fp32 statistics and accumulators; the causal mask applies on the diagonal tile only.
#pragma once
#include "blocksparse_attention.h"
#include "device_utils.cuh"

#include <climits>

namespace minfer {
namespace blocksparse {

constexpr int kTile = kBlocksparseTile;
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kQueryRows = 2 * kTile;  // a block's two query tiles
constexpr int kWarpRows = 32;          // two m16 tiles per warp

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ void ldmatrix_x4_transposed(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// Two fp32 values rounded to T and packed as one mma operand register (`lo` in the low half).
template <typename T>
__device__ __forceinline__ uint32_t round_pair(float lo, float hi) {
    uint32_t bits;
    if constexpr (std::is_same_v<T, half>) {
        const __half2 pair = __floats2half2_rn(lo, hi);
        memcpy(&bits, &pair, sizeof(bits));
    } else {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
        memcpy(&bits, &pair, sizeof(bits));
    }
    return bits;
}

struct Params {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    const int* tile_ptr;
    const int* key_tiles;
    AttnStrides q_strides, k_strides, v_strides, out_strides;
    int seq_len, q_tiles, q_heads, kv_heads, layout_heads;
    float scale_log2;  // softmax scale * log2(e)
};

// Shared-memory tile of `rows` x D with 16-byte chunk c of row r stored at chunk c ^ (r % 8): the 8 row
// addresses of an ldmatrix then fall in 8 distinct bank groups.
template <int D>
__device__ __forceinline__ int swizzled(int row, int chunk) {
    return row * D + ((chunk ^ (row & 7)) * 8);
}

// Copies `rows` rows from global (row `first` on, `row_stride` elements apart) into a swizzled tile;
// rows at or past seq_len are zero-filled, never read.
template <typename T, int D, int kRowsToLoad>
__device__ __forceinline__ void load_tile(T* tile, const T* src, int64_t row_stride, int first, int seq_len) {
    constexpr int kChunks = D / 8;
#pragma unroll
    for (int i = threadIdx.x; i < kRowsToLoad * kChunks; i += kThreads) {
        const int r = i / kChunks, c = i % kChunks;
        const bool valid = first + r < seq_len;
        const T* from = src + (valid ? (int64_t)(first + r) * row_stride : 0) + c * 8;
        cp_async_16(smem_addr(tile + swizzled<D>(r, c)), from, valid);
    }
}

// The two query tiles' key-tile lists, merged: each step yields the next key tile in ascending order
// and which tiles keep it (bit 0: the first, bit 1: the second).
struct MergedLists {
    const int* key_tiles;
    int a, a_end, b, b_end;

    __device__ bool done() const { return a >= a_end && b >= b_end; }

    __device__ int pop(int& keepers) {
        const int ka = a < a_end ? key_tiles[a] : INT_MAX;
        const int kb = b < b_end ? key_tiles[b] : INT_MAX;
        const int k = min(ka, kb);
        keepers = (ka == k ? 1 : 0) | (kb == k ? 2 : 0);
        a += ka == k;
        b += kb == k;
        return k;
    }
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) prefill_kernel(const Params p) {
    constexpr int kChunks = D / 8;
    constexpr int kDimSteps = D / 16;  // k-steps of S = Q K^T
    constexpr int kDimTiles = D / 8;   // n-tiles of O = P V
    constexpr int kKeyTiles = kTile / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* q_smem = reinterpret_cast<T*>(smem_raw);  // [128][D]; each warp's rows later stage its output
    T* kv_smem = q_smem + kQueryRows * D;        // [stage][K, V][64][D]

    const int pair = gridDim.x - 1 - blockIdx.x;  // causal lists grow with the tile: longest first
    const int h = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int half = warp / 2;                     // which of the two query tiles this warp computes
    const int my_tile = 2 * pair + half;
    const int tile_row0 = (warp % 2) * kWarpRows;  // the warp's first row inside its tile
    const int block_row0 = half * kTile + tile_row0;

    const int* lists_of_head = p.tile_ptr + (p.layout_heads == 1 ? 0 : h) * p.q_tiles;
    const int first = 2 * pair;
    const bool has_second = first + 1 < p.q_tiles;  // an odd tile count leaves the last block one tile
    MergedLists lists{p.key_tiles, lists_of_head[first], lists_of_head[first + 1],
                      has_second ? lists_of_head[first + 1] : 0, has_second ? lists_of_head[first + 2] : 0};

    const int kv_head = h / (p.q_heads / p.kv_heads);
    const T* q = static_cast<const T*>(p.q) + b * p.q_strides.batch + h * p.q_strides.head;
    const T* k = static_cast<const T*>(p.k) + b * p.k_strides.batch + kv_head * p.k_strides.head;
    const T* v = static_cast<const T*>(p.v) + b * p.v_strides.batch + kv_head * p.v_strides.head;

    float o[2][kDimTiles][4] = {};
    float row_max[2][2], row_sum[2][2] = {};
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) row_max[mt][0] = row_max[mt][1] = -INFINITY;

    auto load_kv = [&](int key_tile, int stage) {
        T* k_tile = kv_smem + stage * 2 * kTile * D;
        load_tile<T, D, kTile>(k_tile, k, p.k_strides.seq, key_tile * kTile, p.seq_len);
        load_tile<T, D, kTile>(k_tile + kTile * D, v, p.v_strides.seq, key_tile * kTile, p.seq_len);
    };

    if (!lists.done()) {
        int keepers;
        int key_tile = lists.pop(keepers);
        load_tile<T, D, kQueryRows>(q_smem, q, p.q_strides.seq, first * kTile, p.seq_len);
        load_kv(key_tile, 0);
        cp_async_commit();
        for (int n = 0;; ++n) {
            const bool more = !lists.done();
            int next_keepers = 0, next_tile = 0;
            if (more) {
                next_tile = lists.pop(next_keepers);
                load_kv(next_tile, (n + 1) & 1);
            }
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();
            if ((keepers >> half) & 1) {
                const T* k_tile = kv_smem + (n & 1) * 2 * kTile * D;
                const T* v_tile = k_tile + kTile * D;
                // S = Q K^T for the warp's 32 rows and the tile's 64 keys.
                float s[2][kKeyTiles][4] = {};
#pragma unroll
                for (int kk = 0; kk < kDimSteps; ++kk) {
                    uint32_t qa[2][4];
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt)
                        ldmatrix_x4(qa[mt], smem_addr(q_smem + swizzled<D>(block_row0 + mt * 16 + lane % 16,
                                                                            2 * kk + lane / 16)));
#pragma unroll
                    for (int np = 0; np < kKeyTiles / 2; ++np) {
                        uint32_t kb[4];
                        ldmatrix_x4(kb, smem_addr(k_tile + swizzled<D>(np * 16 + lane % 8 + 8 * (lane / 16),
                                                                        2 * kk + (lane / 8) % 2)));
#pragma unroll
                        for (int mt = 0; mt < 2; ++mt) {
                            mma_m16n8k16<T>(s[mt][2 * np], qa[mt], kb[0], kb[1]);
                            mma_m16n8k16<T>(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
                        }
                    }
                }
                if (key_tile == my_tile) {  // the diagonal tile: key j is visible to query i when j <= i
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                        for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const int row = tile_row0 + mt * 16 + lane / 4 + 8 * (e / 2);
                                const int col = nt * 8 + 2 * (lane % 4) + e % 2;
                                if (col > row) s[mt][nt][e] = -INFINITY;
                            }
                }
                // Online softmax: each thread holds rows lane/4 and lane/4 + 8 of both m-tiles; the four
                // lanes of a quad share a row. Every row sees at least one key (its diagonal or a full tile).
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int hr = 0; hr < 2; ++hr) {
                        float mx = -INFINITY;
#pragma unroll
                        for (int nt = 0; nt < kKeyTiles; ++nt)
                            mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hr], s[mt][nt][2 * hr + 1]));
                        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                        const float m_new = fmaxf(row_max[mt][hr], mx * p.scale_log2);
                        const float alpha = fast_exp2(row_max[mt][hr] - m_new);
                        row_max[mt][hr] = m_new;
                        float sum = 0.0f;
#pragma unroll
                        for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
                            for (int e = 2 * hr; e < 2 * hr + 2; ++e) {
                                s[mt][nt][e] = fast_exp2(s[mt][nt][e] * p.scale_log2 - m_new);
                                sum += s[mt][nt][e];
                            }
                        row_sum[mt][hr] = row_sum[mt][hr] * alpha + sum;
#pragma unroll
                        for (int dt = 0; dt < kDimTiles; ++dt) {
                            o[mt][dt][2 * hr] *= alpha;
                            o[mt][dt][2 * hr + 1] *= alpha;
                        }
                    }
                // O += P V: P's accumulator layout is the A operand's (two key n-tiles per k-step).
#pragma unroll
                for (int ks = 0; ks < kTile / 16; ++ks) {
                    uint32_t pa[2][4];
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        pa[mt][0] = round_pair<T>(s[mt][2 * ks][0], s[mt][2 * ks][1]);
                        pa[mt][1] = round_pair<T>(s[mt][2 * ks][2], s[mt][2 * ks][3]);
                        pa[mt][2] = round_pair<T>(s[mt][2 * ks + 1][0], s[mt][2 * ks + 1][1]);
                        pa[mt][3] = round_pair<T>(s[mt][2 * ks + 1][2], s[mt][2 * ks + 1][3]);
                    }
#pragma unroll
                    for (int dp = 0; dp < kDimTiles / 2; ++dp) {
                        uint32_t vb[4];
                        ldmatrix_x4_transposed(vb, smem_addr(v_tile + swizzled<D>(ks * 16 + lane % 8 + 8 * ((lane / 8) % 2),
                                                                                  2 * dp + lane / 16)));
#pragma unroll
                        for (int mt = 0; mt < 2; ++mt) {
                            mma_m16n8k16<T>(o[mt][2 * dp], pa[mt], vb[0], vb[1]);
                            mma_m16n8k16<T>(o[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
                        }
                    }
                }
            }
            __syncthreads();  // the next step's prefetch overwrites this stage
            if (!more) break;
            key_tile = next_tile;
            keepers = next_keepers;
        }
    }

    // Epilogue: O / row sum (zeros for a tile with no kept key tile), staged through the warp's own Q
    // rows (no other warp reads them) so that global stores are 16 bytes wide.
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float sum = row_sum[mt][hr];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            const int row = block_row0 + mt * 16 + lane / 4 + 8 * hr;
#pragma unroll
            for (int dt = 0; dt < kDimTiles; ++dt) {
                *reinterpret_cast<uint32_t*>(q_smem + swizzled<D>(row, dt) + 2 * (lane % 4)) =
                    round_pair<T>(o[mt][dt][2 * hr] * inv, o[mt][dt][2 * hr + 1] * inv);
            }
        }
    __syncwarp();
    T* out = static_cast<T*>(p.out) + b * p.out_strides.batch + h * p.out_strides.head;
    const int out_row0 = first * kTile + block_row0;
#pragma unroll
    for (int i = lane; i < kWarpRows * kChunks; i += 32) {
        const int r = i / kChunks, c = i % kChunks;
        if (out_row0 + r < p.seq_len)
            *reinterpret_cast<uint4*>(out + (int64_t)(out_row0 + r) * p.out_strides.seq + c * 8) =
                *reinterpret_cast<const uint4*>(q_smem + swizzled<D>(block_row0 + r, c));
    }
}

}  // namespace blocksparse
}  // namespace minfer
