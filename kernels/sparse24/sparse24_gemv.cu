// 2:4 decode GEMV on the dense tensor cores. The GEMV is bound by streaming the weights once, so the
// kept values are expanded to dense pairs in registers (two byte permutes per group, their selectors
// computed from the group's metadata nibble) and fed to mma.m16n8k16 exactly as the dense GEMV feeds
// W: 0.5625 of its bytes, the same instruction stream otherwise.
// One block per two 16-row tiles (with silu_mul: a tile is 8 gate rows and their 8 up rows); its warps take
// interleaved steps along K. A warp step is 4 chunks of 32 columns (8 16-byte value pieces per row):
// lane (g, t) reads pieces t and t + 4 of rows g and g + 8, so each load instruction of a warp covers
// 64 contiguous bytes of a row (whole 32-byte sectors), with one metadata word per row holding those pieces'
// nibbles (gemv_meta, sparse24.h: a warp's load is 128 contiguous bytes, 8 rows' words for the step) and
// the matching 16 words of token g's x (tokens 8..15: a second mma tile). Group j of the lane's
// pieces is one m16n8k16: its slots 0,1 are the lane's k slots 2t, 2t+1 and its slots 2,3 the k slots
// 2t+8, 2t+9, for A and B alike. The next weights are in flight while a tile multiplies; the warps' partials
// are reduced in shared memory in a fixed order.
// Fusions (launch.h) as in the dense GEMV: g * x rounded to the dtype feeds the mmas and the per-token
// RMS scale is applied in the epilogue, where the residual is read and added.
#include "sparse24.h"
#include "common/device_utils.cuh"

namespace minfer {

namespace {

constexpr int kTileRows = 16;
constexpr int kGemvMetaStepWords = kSparse24GemvRowGroup * kSparse24GemvStepChunks;  // a step of 8 rows' lanes
constexpr uint32_t kZeroSlots = 0x44444444u;  // byte selector 4: a byte of the zero operand
constexpr uint32_t kPaddingMeta = 0x44444444u;  // slots 0, 1 in every group: the encoding of padding

// The byte-permute selector expanding one group's kept pair (a 32-bit word: value 0 low, value 1 high)
// into its 4 slots: low 16 bits for slots 0,1, high 16 bits for slots 2,3; a slot not kept reads zero.
__device__ __forceinline__ uint32_t slot_selector(uint32_t nibble) {
    const uint32_t first = nibble & 3u, second = (nibble >> 2) & 3u;
    return kZeroSlots ^ (0x54u << (8 * first)) ^ (0x76u << (8 * second));  // 0x44 ^ 0x54 = 0x10, ^ 0x76 = 0x32
}

__device__ __forceinline__ uint4 load_readonly_16B(const void* ptr) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(ptr));
    return r;
}

__device__ __forceinline__ uint32_t component(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// What lane (g, t) reads: rows g and g + 8 of its tile (values as 16-byte pieces, gemv_meta words), x of
// token g (and g + 8), and the norm weight.
struct LaneArrays {
    const uint4* values[2];
    const uint32_t* gemv_meta;
    // The lane's words of step 0 of its two rows, as offsets: one register each where a pointer takes two (with
    // pointers the two-token-tile kernels with the norm fused spill at 128). int: gemv_meta's words stay below
    // 2^31 wherever the values' elements do, which the binding checks.
    int meta_words[2];
    const uint32_t* x[2];
    const uint32_t* norm;
    int chunks;    // metadata words per row
    int x_words;   // 4-byte words of a row of x: cols / 2
};

// One warp step covers 16 rows x 128 columns. Its weights, held in registers from load to multiply: 64
// bytes of values of each of the lane's two rows and their nibbles. Value loads past a row's end feed zeros;
// gemv_meta holds every step (padding words past the row's end).
struct StepWeights {
    uint4 w[2][2];   // [row g, row g + 8][piece t, piece t + 4]
    uint32_t mw[2];  // [row]: the nibbles of piece t (low 16 bits) and piece t + 4 (high 16 bits)

    __device__ __forceinline__ void load(const LaneArrays& a, int step, int t) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int piece = step * 8 + t + 4 * i;
                w[r][i] = piece < 2 * a.chunks ? load_stream_16B(a.values[r] + piece) : make_uint4(0, 0, 0, 0);
            }
            mw[r] = __ldg(a.gemv_meta + a.meta_words[r] + step * kGemvMetaStepWords);
        }
    }
};

// The step's x: 16 words (32 columns) of token g per token tile, and of the norm weight.
template <typename T, int kTiles, bool kNorm>
struct StepX {
    uint32_t xw[kTiles][16];
    uint32_t gw[kNorm ? 16 : 1];

    // Word i of this lane's 16 x words of step `step` (an index into the row of x).
    __device__ __forceinline__ static int x_word(int step, int t, int i) {
        return step * 64 + 8 * t + (i / 8) * 32 + i % 8;
    }

    __device__ __forceinline__ void load(const LaneArrays& a, int step, int t) {
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const int word = x_word(step, t, 4 * p);
            const bool valid = word < a.x_words;
#pragma unroll
            for (int tile = 0; tile < kTiles; ++tile) {
                const uint4 v = valid ? load_coherent_16B(a.x[tile] + word) : make_uint4(0, 0, 0, 0);
                xw[tile][4 * p] = v.x, xw[tile][4 * p + 1] = v.y, xw[tile][4 * p + 2] = v.z, xw[tile][4 * p + 3] = v.w;
            }
            if constexpr (kNorm) {
                const uint4 v = valid ? load_readonly_16B(a.norm + word) : make_uint4(0, 0, 0, 0);
                gw[4 * p] = v.x, gw[4 * p + 1] = v.y, gw[4 * p + 2] = v.z, gw[4 * p + 3] = v.w;
            }
        }
    }

    // RMSNorm fusion: the squares of x into `sum_sq`, then x *= g.
    __device__ __forceinline__ void apply_norm(float (&sum_sq)[kTiles]) {
#pragma unroll
        for (int tile = 0; tile < kTiles; ++tile)
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                const float2 f = pair_to_float2<T>(xw[tile][i]);
                sum_sq[tile] = fmaf(f.x, f.x, fmaf(f.y, f.y, sum_sq[tile]));
                xw[tile][i] = multiply_pairs<T>(xw[tile][i], gw[i]);
            }
    }
};

// Eight m16n8k16 per token tile, one per group: group j's nibble is nibble j of the row's metadata word.
template <typename T, int kTiles, bool kNorm>
__device__ __forceinline__ void multiply_step(const StepWeights& sw, const StepX<T, kTiles, kNorm>& sx,
                                              float (&acc)[kTiles][4]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        uint32_t a[4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint32_t pair = component(sw.w[r][j / 4], j % 4);
            const uint32_t lo = slot_selector((sw.mw[r] >> (4 * j)) & 15u), hi = lo >> 16;
            a[r] = __byte_perm(pair, 0u, lo);      // slots 0, 1
            a[2 + r] = __byte_perm(pair, 0u, hi);  // slots 2, 3
        }
#pragma unroll
        for (int tile = 0; tile < kTiles; ++tile)
            mma_m16n8k16<T>(acc[tile], a, sx.xw[tile][2 * j], sx.xw[tile][2 * j + 1]);
    }
}

// A block owns two consecutive 16-row tiles; a warp step multiplies one x step by each in turn, so x is read
// once per 32 rows (at 16 tokens x is 1.8x a 16-row tile's weight bytes: that L1 traffic held a one-tile block
// back). A step's x is loaded just before its multiplies and the weights of the next (step, row tile) while one
// multiplies, within 128 registers: 16 warps an SM, as 2 blocks of 8 or 1 of 16 (kBlockWarps).
constexpr int kRowTiles = 2;

template <typename T, int kTiles, int kBlockWarps, bool kNorm, bool kSiluMul>
__global__ void __launch_bounds__(kBlockWarps * 32, 16 / kBlockWarps)
    sparse24_gemv_kernel(const T* __restrict__ values, const int32_t* __restrict__ gemv_meta,
                         const T* __restrict__ x, const T* __restrict__ norm_weight, T* __restrict__ out, int tokens,
                         int n, int k, int chunks, float eps, bool accumulate) {
    allow_dependents_to_launch();
    const int lane_id = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane_id >> 2, t = lane_id & 3;
    const int inter = n / 2;  // kSiluMul: gate rows [0, inter), up rows [inter, n)
    const int64_t value_pieces = 2 * (int64_t)chunks;  // 16-byte pieces of a row of values
    const int steps = (chunks + kSparse24GemvStepChunks - 1) / kSparse24GemvStepChunks;
    // The lane's gemv_meta word of a row at step 0: [row / 8][0][row % 8][t].
    auto first_meta_word = [&](int row) {
        return row / kSparse24GemvRowGroup * steps * kGemvMetaStepWords +
               row % kSparse24GemvRowGroup * kSparse24GemvStepChunks + t;
    };
    int rows[kRowTiles];  // the lane's first row in each row tile
    LaneArrays arrays[kRowTiles];
#pragma unroll
    for (int r = 0; r < kRowTiles; ++r) {
        const int tile = blockIdx.x * kRowTiles + r;
        rows[r] = kSiluMul ? tile * 8 + g : tile * kTileRows + g;
        const int lo = kSiluMul ? min(rows[r], inter - 1) : min(rows[r], n - 1);  // rows past the end re-read the last
        const int hi = kSiluMul ? inter + lo : min(rows[r] + 8, n - 1);
        arrays[r].values[0] = reinterpret_cast<const uint4*>(values) + lo * value_pieces;
        arrays[r].values[1] = reinterpret_cast<const uint4*>(values) + hi * value_pieces;
        arrays[r].gemv_meta = reinterpret_cast<const uint32_t*>(gemv_meta);
        arrays[r].meta_words[0] = first_meta_word(lo);
        arrays[r].meta_words[1] = first_meta_word(hi);
        arrays[r].x_words = k / 2;
#pragma unroll
        for (int tile = 0; tile < 2; ++tile) {  // lanes past the last token read token 0: their outputs are not stored
            const int token = g + 8 * tile < tokens ? g + 8 * tile : 0;
            arrays[r].x[tile] = reinterpret_cast<const uint32_t*>(x) + (int64_t)token * arrays[r].x_words;
        }
        arrays[r].norm = reinterpret_cast<const uint32_t*>(norm_weight);
        arrays[r].chunks = chunks;
    }

    StepWeights w_now;
    if (warp < steps) w_now.load(arrays[0], warp, t);
    wait_for_previous_kernel();

    float acc[kRowTiles][kTiles][4] = {};
    float sum_sq[kTiles] = {};
    for (int step = warp; step < steps; step += kBlockWarps) {
        StepX<T, kTiles, kNorm> x_now;
        x_now.load(arrays[0], step, t);  // ahead of the next weights: they wait in the queue
        if constexpr (kNorm) x_now.apply_norm(sum_sq);
#pragma unroll
        for (int r = 0; r < kRowTiles; ++r) {
            StepWeights w_next;
            const bool last = r == kRowTiles - 1;
            if (!last || step + kBlockWarps < steps)
                w_next.load(arrays[last ? 0 : r + 1], last ? step + kBlockWarps : step, t);
            multiply_step<T, kTiles, kNorm>(w_now, x_now, acc[r]);
            w_now = w_next;
        }
    }

    __shared__ float4 partial[kBlockWarps - 1][kRowTiles][kTiles][32];
    __shared__ float sum_sq_part[kNorm ? kBlockWarps : 1][kTiles * 8];
    if (warp > 0)
#pragma unroll
        for (int r = 0; r < kRowTiles; ++r)
#pragma unroll
            for (int tile = 0; tile < kTiles; ++tile) {
                const float* c = acc[r][tile];
                partial[warp - 1][r][tile][lane_id] = make_float4(c[0], c[1], c[2], c[3]);
            }
    if constexpr (kNorm) {
#pragma unroll
        for (int tile = 0; tile < kTiles; ++tile) {
            float s = sum_sq[tile];  // the 4 lanes of row group g hold token g (+ 8 * tile)
            s += __shfl_xor_sync(0xffffffffu, s, 1);
            s += __shfl_xor_sync(0xffffffffu, s, 2);
            if (t == 0) sum_sq_part[warp][tile * 8 + g] = s;
        }
    }
    __syncthreads();
    if (warp > 0) return;
#pragma unroll
    for (int r = 0; r < kRowTiles; ++r) {
        const int row = rows[r];
        float (&c)[kTiles][4] = acc[r];
#pragma unroll
        for (int i = 0; i < kBlockWarps - 1; ++i)
#pragma unroll
            for (int tile = 0; tile < kTiles; ++tile) {
                const float4 p = partial[i][r][tile][lane_id];
                c[tile][0] += p.x;
                c[tile][1] += p.y;
                c[tile][2] += p.z;
                c[tile][3] += p.w;
            }
        // mma accumulator layout: lane (g, t) holds rows g and g + 8 for tokens 2t and 2t + 1 of its tile.
#pragma unroll
        for (int tile = 0; tile < kTiles; ++tile)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int token = 8 * tile + 2 * t + j;
                if (token >= tokens) continue;
                float scale = 1.0f;
                if constexpr (kNorm) scale = rms_scale(sum_sq_part, token, k, eps);
                const float lo_sum = c[tile][j] * scale, hi_sum = c[tile][2 + j] * scale;
                if constexpr (kSiluMul) {
                    if (row < inter) out[(int64_t)token * inter + row] = from_float<T>(silu_times(lo_sum, hi_sum));
                    continue;
                }
                const int64_t lo = (int64_t)token * n + row, hi = lo + 8;
                if (row < n) out[lo] = from_float<T>(lo_sum + (accumulate ? to_float(out[lo]) : 0.0f));
                if (row + 8 < n) out[hi] = from_float<T>(hi_sum + (accumulate ? to_float(out[hi]) : 0.0f));
            }
    }
}

// Fallback for x that is not 16-byte aligned (cols % 8 != 0, offset views): one warp per output row
// (with silu_mul: per gate row and its up row), one group per lane at a time, scalar loads.
template <typename T>
__global__ void sparse24_gemv_scalar_kernel(const T* __restrict__ values, const int32_t* __restrict__ meta,
                                            const T* __restrict__ x, const T* __restrict__ norm_weight,
                                            T* __restrict__ out, int tokens, int n, int k, int chunks, float eps,
                                            bool accumulate, bool silu_mul) {
    const int lane = threadIdx.x & 31;
    const int outputs = silu_mul ? n / 2 : n;
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= outputs) return;
    const int value_cols = chunks * kSparse24ChunkCols / 2;
    // The dense 4 columns of group `group` of row `r`.
    auto group_weights = [&](int r, int group, float (&w)[4]) {
        const uint32_t nibble = ((uint32_t)meta[(int64_t)r * chunks + group / 8] >> (4 * (group % 8))) & 15u;
        w[0] = w[1] = w[2] = w[3] = 0.0f;
        w[nibble & 3u] = to_float(values[(int64_t)r * value_cols + 2 * group]);
        w[(nibble >> 2) & 3u] = to_float(values[(int64_t)r * value_cols + 2 * group + 1]);
    };
    float acc[kSparse24MaxTokens] = {}, up_acc[kSparse24MaxTokens] = {}, sum_sq[kSparse24MaxTokens] = {};
    for (int group = lane; group * 4 < k; group += 32) {
        float w[4], up[4] = {};
        group_weights(row, group, w);
        if (silu_mul) group_weights(row + outputs, group, up);
#pragma unroll
        for (int slot = 0; slot < 4; ++slot) {
            const int col = group * 4 + slot;
            if (col >= k) break;
            const float gv = norm_weight ? to_float(norm_weight[col]) : 1.0f;
#pragma unroll
            for (int tok = 0; tok < kSparse24MaxTokens; ++tok) {
                if (tok >= tokens) break;
                float xv = to_float(x[(int64_t)tok * k + col]);
                if (norm_weight) {
                    sum_sq[tok] = fmaf(xv, xv, sum_sq[tok]);
                    xv = to_float(from_float<T>(xv * gv));  // rounded as on the tensor-core path
                }
                acc[tok] = fmaf(w[slot], xv, acc[tok]);
                up_acc[tok] = fmaf(up[slot], xv, up_acc[tok]);
            }
        }
    }
    store_scalar_projection(acc, up_acc, sum_sq, out, tokens, outputs, row, k, eps, norm_weight != nullptr, accumulate,
                            silu_mul);
}

struct GemvArgs {
    const void* values;
    const int32_t* meta;
    const int32_t* gemv_meta;
    const void* x;
    void* out;
    int tokens, n, k, chunks;
    ProjectionFusion fusion;
    cudaStream_t stream;
};

template <typename T, int kTiles, bool kNorm, bool kSiluMul>
void launch_mma(const GemvArgs& a) {
    const int tiles = kSiluMul ? ceil_div(a.n / 2, 8) : ceil_div(a.n, kTileRows);
    auto launch = [&](auto kernel, int blocks, int warps) {
        launch_with_pdl(kernel, dim3((unsigned)blocks), dim3(warps * 32), 0, a.stream, true,
                        static_cast<const T*>(a.values), a.gemv_meta, static_cast<const T*>(a.x),
                        static_cast<const T*>(a.fusion.norm_weight), static_cast<T*>(a.out), a.tokens, a.n, a.k,
                        a.chunks, a.fusion.eps, a.fusion.accumulate);
    };
    // Blocks of 8 warps, 2 an SM, where they fill every block slot, else of 16 (4096 rows: 128 blocks). Against
    // one row tile a block of 8 warps (H200): 1 token 1.33-1.44x -> 1.33-1.50x the dense GEMV, 16 tokens
    // 1.01-1.41x -> 1.36-1.66x cuBLAS (the 4096-row shapes: 0.90-1.08x with 8-warp blocks).
    const int blocks = ceil_div(tiles, kRowTiles);
    if (blocks >= 2 * multiprocessors(current_device()))
        return launch(sparse24_gemv_kernel<T, kTiles, 8, kNorm, kSiluMul>, blocks, 8);
    launch(sparse24_gemv_kernel<T, kTiles, 16, kNorm, kSiluMul>, blocks, 16);
}

template <typename T, int kTiles>
void launch_fusions(const GemvArgs& a) {
    if (a.fusion.norm_weight)
        return a.fusion.silu_mul ? launch_mma<T, kTiles, true, true>(a) : launch_mma<T, kTiles, true, false>(a);
    return a.fusion.silu_mul ? launch_mma<T, kTiles, false, true>(a) : launch_mma<T, kTiles, false, false>(a);
}

template <typename T>
void launch_typed(const GemvArgs& a) {
    auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    if (a.k % 8 != 0 || !aligned16(a.x) || !aligned16(a.values) || !aligned16(a.fusion.norm_weight)) {
        constexpr int kRowsPerBlock = 8;
        const int outputs = a.fusion.silu_mul ? a.n / 2 : a.n;
        sparse24_gemv_scalar_kernel<T><<<ceil_div(outputs, kRowsPerBlock), kRowsPerBlock * 32, 0, a.stream>>>(
            static_cast<const T*>(a.values), a.meta, static_cast<const T*>(a.x),
            static_cast<const T*>(a.fusion.norm_weight), static_cast<T*>(a.out), a.tokens, a.n, a.k, a.chunks,
            a.fusion.eps, a.fusion.accumulate, a.fusion.silu_mul);
        return;
    }
    if (a.tokens <= 8) return launch_fusions<T, 1>(a);
    return launch_fusions<T, 2>(a);
}

// One thread per group: its kept pair expanded by the GEMV's byte permute, stored as 8 bytes when the
// row allows, element by element otherwise.
template <typename T>
__global__ void sparse24_decompress_kernel(const uint32_t* __restrict__ pairs, const int32_t* __restrict__ meta,
                                           T* __restrict__ out, int rows, int cols, int chunks) {
    const int groups = chunks * (kSparse24ChunkCols / 4);  // per row, padding included
    const int64_t index = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (index >= (int64_t)rows * groups) return;
    const int row = (int)(index / groups), group = (int)(index % groups), col = group * 4;
    if (col >= cols) return;
    const uint32_t nibble = ((uint32_t)__ldg(meta + (int64_t)row * chunks + group / 8) >> (4 * (group % 8))) & 15u;
    const uint32_t selector = slot_selector(nibble), pair = __ldg(pairs + index);
    const uint32_t lo = __byte_perm(pair, 0u, selector), hi = __byte_perm(pair, 0u, selector >> 16);
    T* dst = out + (int64_t)row * cols + col;
    if (cols % 4 == 0 && reinterpret_cast<uintptr_t>(out) % 8 == 0) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
        return;
    }
    const uint32_t slots[2] = {lo, hi};
    for (int s = 0; s < 4 && col + s < cols; ++s) {
        const uint16_t bits = (uint16_t)(slots[s / 2] >> (16 * (s % 2)));
        memcpy(dst + s, &bits, sizeof(bits));
    }
}

// One thread per gemv_meta word, in its order (the stores coalesce): the byte permute that picks the lane's
// halves of the row's two meta words.
__global__ void sparse24_gemv_metadata_kernel(const uint32_t* __restrict__ meta, uint32_t* __restrict__ gemv_meta,
                                              int64_t rows, int64_t chunks, int64_t steps, int64_t words) {
    const int64_t index = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (index >= words) return;
    const int t = (int)(index % kSparse24GemvStepChunks);
    const int64_t row_group = index / kGemvMetaStepWords / steps, step = index / kGemvMetaStepWords % steps;
    const int64_t row = row_group * kSparse24GemvRowGroup + index / kSparse24GemvStepChunks % kSparse24GemvRowGroup;
    auto meta_word = [&](int64_t word) {
        return row < rows && word < chunks ? __ldg(meta + row * chunks + word) : kPaddingMeta;
    };
    const int64_t first = step * kSparse24GemvStepChunks + t / 2;  // piece t's word; piece t + 4's is 2 words on
    gemv_meta[index] = __byte_perm(meta_word(first), meta_word(first + 2), (t & 1) ? 0x7632 : 0x5410);
}

}  // namespace

void launch_sparse24_gemv_metadata(const int32_t* meta, int64_t rows, int64_t chunks, int32_t* gemv_meta,
                                   cudaStream_t stream) {
    const int64_t steps = (chunks + kSparse24GemvStepChunks - 1) / kSparse24GemvStepChunks;
    const int64_t row_groups = (rows + kSparse24GemvRowGroup - 1) / kSparse24GemvRowGroup;
    const int64_t words = row_groups * steps * kGemvMetaStepWords;
    if (words == 0) return;
    constexpr int kBlock = 256;
    sparse24_gemv_metadata_kernel<<<(unsigned)((words + kBlock - 1) / kBlock), kBlock, 0, stream>>>(
        reinterpret_cast<const uint32_t*>(meta), reinterpret_cast<uint32_t*>(gemv_meta), rows, chunks, steps, words);
}

void launch_sparse24_gemv(const void* values, const int32_t* meta, const int32_t* gemv_meta, const void* x,
                          void* out, int64_t tokens, int64_t rows, int64_t cols, DType dtype,
                          const ProjectionFusion& fusion, cudaStream_t stream) {
    const int chunks = (int)((cols + kSparse24ChunkCols - 1) / kSparse24ChunkCols);
    const GemvArgs args{values, meta, gemv_meta, x, out, (int)tokens, (int)rows, (int)cols, chunks, fusion, stream};
    switch (dtype) {
        case DType::kFloat16: launch_typed<half>(args); break;
        case DType::kBFloat16: launch_typed<__nv_bfloat16>(args); break;
        case DType::kFloat32: break;  // rejected by the binding: the tensor cores take 16-bit inputs
    }
}

void launch_sparse24_decompress(const void* values, const int32_t* meta, void* out, int64_t rows, int64_t cols,
                                DType dtype, cudaStream_t stream) {
    const int chunks = (int)((cols + kSparse24ChunkCols - 1) / kSparse24ChunkCols);
    const int64_t threads = rows * chunks * (kSparse24ChunkCols / 4);
    if (threads == 0) return;
    constexpr int kBlock = 256;
    const unsigned blocks = (unsigned)((threads + kBlock - 1) / kBlock);
    const auto* pairs = static_cast<const uint32_t*>(values);
    switch (dtype) {
        case DType::kFloat16:
            sparse24_decompress_kernel<half><<<blocks, kBlock, 0, stream>>>(pairs, meta, static_cast<half*>(out),
                                                                            (int)rows, (int)cols, chunks);
            break;
        case DType::kBFloat16:
            sparse24_decompress_kernel<__nv_bfloat16><<<blocks, kBlock, 0, stream>>>(
                pairs, meta, static_cast<__nv_bfloat16*>(out), (int)rows, (int)cols, chunks);
            break;
        case DType::kFloat32: break;  // rejected by the binding
    }
}

}  // namespace minfer
