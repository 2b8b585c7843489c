// MACKO-16-4 SpMV / SpMM and decompression, tuned for Hopper (see docs/perf-notes.md, "MACKO").
//
// Work split: one warp walks one row at a time (persistent grid, rows strided over all warps).
// Each lane takes 8 consecutive entries per warp step (16 B of values, 4 B of nibbles, the same
// "mutual alignment" as the reference kernel); a warp step covers 256 entries. Compared with the
// reference kernel:
// - loads are double-buffered: the next group of `STEPS` warp steps (possibly the first group of
//   the warp's next row, whose row_ptr was prefetched) is in flight while the current one is decoded;
// - x is staged once per block in shared memory (fp32 for one token, [cols][TT] fp16/bf16 for TT
//   tokens) and gathered from there; the staging overlaps the first weight loads;
// - nibble prefix sums inside a chunk use byte-parallel arithmetic (one multiply), and the warp scan
//   of the chunk sums covers two steps at once (16-bit fields);
// - the one-token consumer (decode) gathers x with 5 instructions per entry; with it the kernel
//   waits mostly on the latency of the warp scan, not on DRAM (docs/perf-notes.md, the 2026-11-23 2519932 entry); it
//   also fuses a Llama sublayer's RMSNorm (into the staging of x) and, walking the MLP's gate and up
//   rows in pairs, silu(gate) * up (into the row ends);
// - SpMM reads the compressed weights once for up to 16 tokens (x as [cols][TT] vectors in smem).
#include <map>
#include <mutex>
#include <tuple>

#include "macko.h"
#include "macko_walk.cuh"

namespace minfer {

namespace {

// The reference kernel's schedule, kept as the benchmark's baseline: each group is loaded, then
// decoded, with nothing in flight meanwhile.
template <int STEPS, class Consumer>
__device__ __forceinline__ void walk_rows_unpipelined(const uint4* __restrict__ values,
                                                      const uint32_t* __restrict__ deltas,
                                                      const int* __restrict__ row_ptr, int rows, int first_row,
                                                      int stride, int lane, Consumer& consumer) {
    consumer.stage();
    for (int row = first_row; row < rows; row += stride) {
        const int s = row_ptr[row], e = row_ptr[row + 1];
        int carry = 0;
        consumer.begin_row(row);
        for (int a = s & ~(kChunk - 1); a < e; a += STEPS * kStep) {
            Group<STEPS> g{};
            load_batch(values, deltas, GroupCursor{row, s, e, a}, lane, g);
            decode_group(g, a, s, e, carry, lane, consumer);
        }
        consumer.end_row(row);
    }
}

// With NORM, the sum of x^2 is kept per 8-column vector (vector_squares[v], in shared memory after
// x) and summed in a fixed order after the staging barrier (vector_squares_total): the norm's scale
// then does not depend on the block size, so launches of different shapes (the fused silu's pair
// walk, the plain SpMV) agree bit for bit.
__host__ __device__ constexpr int vector_count(int cols) { return (cols + 7) / 8; }

// Every warp computes it: lane l adds vectors l, l + 32, ... in order, then a warp sum.
__device__ __forceinline__ float vector_squares_total(const float* vector_squares, int cols) {
    float total = 0.f;
    for (int v = threadIdx.x % kWarpSize; v < vector_count(cols); v += kWarpSize) total += vector_squares[v];
    return warp_sum(total);
}

// x (one token) -> shared memory as fp32; with NORM, g * x (rounded to T) and vector_squares. Vector
// loads are issued in batches before their first use, so a block waits about one L2 round trip
// however long x is. Coherent loads: the previous kernel may have written x (PDL).
template <typename T, bool NORM>
__device__ __forceinline__ void stage_x_fp32(const uint16_t* x, const uint16_t* g, int cols, float* xs,
                                             float* vector_squares) {
    if (cols % 8 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0 || reinterpret_cast<uintptr_t>(g) % 16 != 0) {
        const auto stage_column = [&](int i) {
            const float xi = bits_to_float<T>(load_coherent_u16(x + i));
            if constexpr (NORM) xs[i] = to_float(from_float<T>(xi * bits_to_float<T>(g[i])));  // exact in fp32
            else xs[i] = xi;
            return xi;
        };
        for (int v = threadIdx.x; v < vector_count(cols); v += blockDim.x) {
            float squares = 0.f;
            for (int i = 8 * v; i < 8 * v + 8 && i < cols; i += 2) {
                const float x0 = stage_column(i), x1 = i + 1 < cols ? stage_column(i + 1) : 0.f;
                squares = fmaf(x0, x0, fmaf(x1, x1, squares));  // the vector path's order: odd column first
            }
            if constexpr (NORM) vector_squares[v] = squares;
        }
        return;
    }
    const auto widen = [&](uint32_t xw, uint32_t gw, float& squares) {
        if constexpr (NORM) {
            const float2 f = pair_to_float2<T>(xw);
            squares = fmaf(f.x, f.x, fmaf(f.y, f.y, squares));
            xw = multiply_pairs<T>(xw, gw);
        }
        return pair_to_float2<T>(xw);
    };
    constexpr int kBatch = 4;
    const int vectors = cols / 8;
    for (int first = threadIdx.x; first < vectors; first += kBatch * blockDim.x) {
        uint4 v[kBatch], gv[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const int i = first + u * blockDim.x;
            v[u] = i < vectors ? load_coherent_16B(x + 8 * i) : make_uint4(0, 0, 0, 0);
            if constexpr (NORM)
                gv[u] = i < vectors ? __ldg(reinterpret_cast<const uint4*>(g) + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const int i = first + u * blockDim.x;
            if (i >= vectors) break;
            float squares = 0.f;
            const float2 a = widen(v[u].x, gv[u].x, squares), b = widen(v[u].y, gv[u].y, squares);
            const float2 c = widen(v[u].z, gv[u].z, squares), d = widen(v[u].w, gv[u].w, squares);
            reinterpret_cast<float4*>(xs)[2 * i] = make_float4(a.x, a.y, b.x, b.y);
            reinterpret_cast<float4*>(xs)[2 * i + 1] = make_float4(c.x, c.y, d.x, d.y);
            if constexpr (NORM) vector_squares[i] = squares;
        }
    }
}

// y[t, row] for TT tokens. X_IN_SMEM: x staged in shared memory as [cols][TT] in T (TT >= 2; one
// token with x in shared memory runs macko_spmv_one_token_kernel); otherwise gathered from global
// memory (TT == 1 only). PDL: launched as a
// programmatic dependent, so x is read only after griddepcontrol.wait and never with `.nc` loads.
template <typename T, int TT, bool X_IN_SMEM, bool PDL>
struct SpmvConsumer {
    static_assert(X_IN_SMEM || TT == 1, "the global-x path handles one token per pass");
    static_assert(!X_IN_SMEM || TT >= 2, "one token with x in shared memory: macko_spmv_one_token_kernel");
    const uint16_t* x;  // this pass's first token
    T* __restrict__ out;      // this pass's first token
    void* smem;
    int rows, cols, tokens;   // tokens left from this pass's first one
    int lane;
    bool accumulate;          // out += W x
    float acc[TT];

    __device__ __forceinline__ uint32_t load_x(int64_t i) const {
        if constexpr (PDL) return load_coherent_u16(x + i);
        else return __ldg(x + i);
    }

    // Column `col` of the [cols][TT] tile: TT/2 words, word p = tokens 2p (low half) and 2p + 1.
    __device__ __forceinline__ void store_column(uint32_t* xs, int col, const uint32_t (&w)[TT / 2]) const {
        uint32_t* dst = xs + (int64_t)col * (TT / 2);
        if constexpr (TT == 2) {
            dst[0] = w[0];
        } else if constexpr (TT == 4) {
            *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
        } else {
#pragma unroll
            for (int q = 0; q < TT / 8; ++q)
                reinterpret_cast<uint4*>(dst)[q] = make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
        }
    }

    // One column per thread, all TT tokens, two columns' loads in flight before their stores
    // (consecutive threads store consecutive columns: no bank conflicts).
    __device__ __forceinline__ void stage_tokens(uint32_t* xs) const {
        constexpr int kBatch = 2;
        for (int first = threadIdx.x; first < cols; first += kBatch * blockDim.x) {
            uint32_t w[kBatch][TT / 2];
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                const int i = first + u * blockDim.x;
#pragma unroll
                for (int p = 0; p < TT / 2; ++p) {
                    const uint32_t lo = i < cols && 2 * p < tokens ? load_x((int64_t)(2 * p) * cols + i) : 0u;
                    const uint32_t hi = i < cols && 2 * p + 1 < tokens ? load_x((int64_t)(2 * p + 1) * cols + i) : 0u;
                    w[u][p] = lo | (hi << 16);
                }
            }
#pragma unroll
            for (int u = 0; u < kBatch; ++u)
                if (first + u * blockDim.x < cols) store_column(xs, first + u * blockDim.x, w[u]);
        }
    }

    __device__ __forceinline__ void stage() {
        if constexpr (PDL) {
            allow_dependents_to_launch();
            wait_for_previous_kernel();
        }
        if constexpr (X_IN_SMEM) {
            stage_tokens(static_cast<uint32_t*>(smem));
            __syncthreads();
        }
    }

    __device__ __forceinline__ void begin_row(int) {
#pragma unroll
        for (int t = 0; t < TT; ++t) acc[t] = 0.f;
    }

    template <bool CHECK>
    __device__ __forceinline__ void chunk(const uint4& v, const ChunkNibbles& nib, int base, int c0, int s, int e) {
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
            if (CHECK && (c0 + j < s || c0 + j >= e)) continue;
            const int col = base + j + nib.prefix(j);
            const float w = value_at<T>(v, j);
            if constexpr (!X_IN_SMEM) {
                acc[0] = fmaf(w, bits_to_float<T>(load_x(col)), acc[0]);
            } else {
                const uint32_t* src = static_cast<const uint32_t*>(smem) + (int64_t)col * (TT / 2);
                uint32_t xw[TT / 2];
                if constexpr (TT == 2) {
                    xw[0] = src[0];
                } else if constexpr (TT == 4) {
                    const uint2 q = *reinterpret_cast<const uint2*>(src);
                    xw[0] = q.x;
                    xw[1] = q.y;
                } else {
#pragma unroll
                    for (int q = 0; q < TT / 8; ++q) {
                        const uint4 u = reinterpret_cast<const uint4*>(src)[q];
                        xw[4 * q] = u.x;
                        xw[4 * q + 1] = u.y;
                        xw[4 * q + 2] = u.z;
                        xw[4 * q + 3] = u.w;
                    }
                }
#pragma unroll
                for (int p = 0; p < TT / 2; ++p) {
                    const float2 xf = pair_to_float2<T>(xw[p]);
                    acc[2 * p] = fmaf(w, xf.x, acc[2 * p]);
                    acc[2 * p + 1] = fmaf(w, xf.y, acc[2 * p + 1]);
                }
            }
        }
    }

    __device__ __forceinline__ void end_row(int row) {
        float mine = 0.f;  // lane t keeps token t's sum
#pragma unroll
        for (int t = 0; t < TT; ++t) {
            const float sum = warp_sum(acc[t]);
            if (lane == t) mine = sum;
        }
        if (lane < TT && lane < tokens) {
            const int64_t idx = (int64_t)lane * rows + row;
            out[idx] = from_float<T>(mine + (accumulate ? to_float(out[idx]) : 0.0f));
        }
    }
};

template <typename T, int TT, int STEPS, bool X_IN_SMEM, bool PIPELINE>
__global__ void __launch_bounds__(kMaxThreads) macko_spmv_kernel(const uint4* __restrict__ values,
                                                                 const uint32_t* __restrict__ deltas,
                                                                 const int* __restrict__ row_ptr,
                                                                 const uint16_t* x, T* __restrict__ out,
                                                                 int rows, int cols, int tokens, bool accumulate) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int warps = blockDim.x / kWarpSize;
    const int lane = threadIdx.x % kWarpSize;
    const int token0 = blockIdx.y * TT;
    SpmvConsumer<T, TT, X_IN_SMEM, PIPELINE> consumer{x + (int64_t)token0 * cols, out + (int64_t)token0 * rows, smem,
                                            rows, cols, tokens - token0, lane, accumulate, {}};
    const int first_row = blockIdx.x * warps + threadIdx.x / kWarpSize;
    if constexpr (PIPELINE)
        walk_rows<STEPS>(values, deltas, row_ptr, rows, first_row, gridDim.x * warps, lane, consumer);
    else
        walk_rows_unpipelined<STEPS>(values, deltas, row_ptr, rows, first_row, gridDim.x * warps, lane, consumer);
}

// ---- One token, x in shared memory: the decode kernel ----
// walk_rows with a consumer that fetches each entry's x with a byte permute, one address add and a
// shared load with the entry's offset as its immediate (5 instructions per entry).

// acc += the chunk's entries [first, end) (all 8 unless CHECK) times x; xb is the shared-memory
// address of x[base]. Per entry: a byte permute (its prefix), one address add, and a shared load
// whose immediate carries the entry's offset j.
template <typename T, bool CHECK>
__device__ __forceinline__ void chunk_dot(const uint4& v, const ChunkNibbles& nib, uint32_t xb, int first, int end,
                                          float2& acc) {
    asm("mov.b32 %0, %0;" : "+r"(xb));  // keeps x[base]'s address whole: the compiler would re-add base per entry
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
        if (CHECK && (j < first || j >= end)) continue;
        const uint32_t prefix = __byte_perm(j & 1 ? nib.odd : nib.even, 0, 0x4440 + (j >> 1));
        float xj;
        asm("ld.shared.f32 %0, [%1];" : "=f"(xj) : "r"(xb + 4 * prefix + 4 * j));
        const float w = value_at<T>(v, j);
        if (j & 1)
            acc.y = fmaf(w, xj, acc.y);
        else
            acc.x = fmaf(w, xj, acc.x);
    }
}

// out[row] (+)= W[row] . x for one token (blockIdx.y picks it), x staged in shared memory as fp32.
// Launched as a PDL dependent: stage() runs after the first batch of weights is requested. NORM:
// x is the RMSNorm of the token (MackoNorm); every block computes the token's scale itself, from
// the x it stages anyway, so the norm costs no kernel and no pass over x of its own. SILU: W is
// [gate; up] (walked in pairs) and out[p] = silu(gate[p]) * up[p], both rounded to T first, as the
// silu_mul kernel reads them from a [gate; up] output: fusing changes no bit of the result.
template <typename T, bool NORM, bool SILU>
struct OneTokenConsumer {
    const uint16_t* x;
    T* __restrict__ out;
    float* xs;
    const uint16_t* norm_weight;
    float eps;
    int cols, lane;
    bool accumulate;
    int half_rows;         // SILU: gate rows [0, half_rows), up rows [half_rows, 2 half_rows)
    uint32_t xs_addr = 0;  // shared-memory address of xs
    float row_scale = 1.f;
    float residual = 0.f;  // accumulate: out[row], read when the row begins
    float gate = 0.f;      // SILU: the current pair's gate output
    float2 acc = make_float2(0.f, 0.f);

    __device__ __forceinline__ void stage() {
        allow_dependents_to_launch();
        wait_for_previous_kernel();
        stage_x_fp32<T, NORM>(x, norm_weight, cols, xs, xs + cols);
        __syncthreads();
        if constexpr (NORM) row_scale = rsqrtf(vector_squares_total(xs + cols, cols) / cols + eps);
        xs_addr = smem_addr(xs);
    }

    // The residual's L2 round trip overlaps the row's decode instead of delaying its store (o and down
    // give most warps a single row, so that delay was the kernel's tail).
    __device__ __forceinline__ void begin_row(int row) {
        acc = make_float2(0.f, 0.f);
        if (!SILU && accumulate && lane == 0) residual = to_float(out[row]);
    }

    template <bool CHECK>
    __device__ __forceinline__ void chunk(const uint4& v, const ChunkNibbles& nib, int base, int c0, int s, int e) {
        chunk_dot<T, CHECK>(v, nib, xs_addr + 4 * base, s - c0, e - c0, acc);
    }

    __device__ __forceinline__ void end_row(int row) {
        float sum = warp_sum(acc.x + acc.y);
        if constexpr (NORM) sum *= row_scale;
        if constexpr (SILU) {
            const float rounded = to_float(from_float<T>(sum));
            if (row < half_rows) {
                gate = rounded;  // its up row comes next (RowGroups<STEPS, true>)
            } else if (lane == 0) {
                out[row - half_rows] = from_float<T>(gate / (1.0f + __expf(-gate)) * rounded);
            }
        } else if (lane == 0) {
            out[row] = from_float<T>(sum + residual);
        }
    }
};

template <typename T, int STEPS, bool NORM, bool SILU>
__global__ void __launch_bounds__(kMaxThreads) macko_spmv_one_token_kernel(const uint4* __restrict__ values,
                                                                           const uint32_t* __restrict__ deltas,
                                                                           const int* __restrict__ row_ptr,
                                                                           const uint16_t* x, T* __restrict__ out,
                                                                           const uint16_t* __restrict__ norm_weight,
                                                                           float eps, int rows, int cols,
                                                                           bool accumulate) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int warps = blockDim.x / kWarpSize;
    const int lane = threadIdx.x % kWarpSize;
    const int outputs = SILU ? rows / 2 : rows;
    OneTokenConsumer<T, NORM, SILU> consumer{x + (int64_t)blockIdx.y * cols, out + (int64_t)blockIdx.y * outputs,
                                             reinterpret_cast<float*>(smem), norm_weight, eps, cols, lane,
                                             accumulate, rows / 2};
    walk_rows<STEPS, SILU>(values, deltas, row_ptr, rows, blockIdx.x * warps + threadIdx.x / kWarpSize,
                           gridDim.x * warps, lane, consumer);
}

// Dense rows. ROW_IN_SMEM: each warp assembles its row in shared memory (zeros, then the scattered
// entries) and writes it out with coalesced 16-byte stores; otherwise (rows too long for shared
// memory) it zero-fills the row in global memory and scatters the entries there.
template <bool ROW_IN_SMEM>
struct DecompressConsumer {
    uint16_t* __restrict__ out;
    uint16_t* row_buffer;  // this warp's shared-memory row (ROW_IN_SMEM)
    int cols;
    int lane;
    bool vector_rows;  // output rows are 16-byte aligned whole vectors
    uint16_t* row_out = nullptr;
    uint16_t* dst = nullptr;  // where entries land: row_buffer or row_out

    __device__ __forceinline__ void stage() {}

    __device__ __forceinline__ void begin_row(int row) {
        row_out = out + (int64_t)row * cols;
        dst = ROW_IN_SMEM ? row_buffer : row_out;
        if (ROW_IN_SMEM || vector_rows) {  // the shared row is padded to whole vectors
            for (int c = lane * 8; c < cols; c += kWarpSize * 8)
                *reinterpret_cast<uint4*>(dst + c) = make_uint4(0, 0, 0, 0);
        } else {
            for (int c = lane; c < cols; c += kWarpSize) dst[c] = 0;
        }
        __syncwarp();  // the zeros land before this warp's scattered entries
    }

    template <bool CHECK>
    __device__ __forceinline__ void chunk(const uint4& v, const ChunkNibbles& nib, int base, int c0, int s, int e) {
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
            if (CHECK && (c0 + j < s || c0 + j >= e)) continue;
            const uint32_t w = word_of(v, j >> 1);
            dst[base + j + nib.prefix(j)] = (uint16_t)((j & 1) ? (w >> 16) : (w & 0xffffu));
        }
    }

    __device__ __forceinline__ void end_row(int) {
        if constexpr (ROW_IN_SMEM) {
            __syncwarp();  // every entry is in the shared row
            if (vector_rows) {
                for (int c = lane * 8; c < cols; c += kWarpSize * 8)
                    *reinterpret_cast<uint4*>(row_out + c) = *reinterpret_cast<const uint4*>(row_buffer + c);
            } else {
                for (int c = lane; c < cols; c += kWarpSize) row_out[c] = row_buffer[c];
            }
            __syncwarp();  // copied out before the next row zeroes the buffer
        }
    }
};

// 8-warp blocks held to 85 registers, 3 per SM: the row buffers of K = 4096 allow 3, and the
// two-batch walker would otherwise take 86 and fit 2.
constexpr int kDecompressWarpsPerBlock = 8;

template <int STEPS, bool ROW_IN_SMEM>
__global__ void __launch_bounds__(kDecompressWarpsPerBlock * kWarpSize, 3) macko_decompress_kernel(const uint4* __restrict__ values,
                                                                       const uint32_t* __restrict__ deltas,
                                                                       const int* __restrict__ row_ptr,
                                                                       uint16_t* __restrict__ out, int rows,
                                                                       int cols) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x / kWarpSize;
    const int lane = threadIdx.x % kWarpSize;
    uint16_t* row_buffer = reinterpret_cast<uint16_t*>(smem) + (int64_t)warp * ((cols + 7) & ~7);
    const bool vector_rows = cols % 8 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
    DecompressConsumer<ROW_IN_SMEM> consumer{out, row_buffer, cols, lane, vector_rows};
    const int warps = blockDim.x / kWarpSize;
    walk_rows<STEPS>(values, deltas, row_ptr, rows, blockIdx.x * warps + warp, gridDim.x * warps, lane, consumer);
}

// ---------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------

// Defaults from the launch sweep on an H100 (docs/perf-notes.md, "MACKO"): 2 steps per stage,
// 16 warps per block (at most, for one token: balanced_grid), x in shared memory whenever it fits.
constexpr int kDefaultSteps = 2;
constexpr int kDefaultWarpsPerBlock = 16;

struct DeviceLimits {
    int sm_count;
    int smem_optin;  // dynamic shared memory one block may opt into
};

DeviceLimits device_limits() {
    static std::mutex mutex;
    static std::map<int, DeviceLimits> cache;
    int device = 0;
    cudaGetDevice(&device);
    std::lock_guard<std::mutex> lock(mutex);
    auto it = cache.find(device);
    if (it == cache.end()) {
        DeviceLimits limits{};
        cudaDeviceGetAttribute(&limits.sm_count, cudaDevAttrMultiProcessorCount, device);
        cudaDeviceGetAttribute(&limits.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
        it = cache.emplace(device, limits).first;
    }
    return it->second;
}

// Blocks of `kernel` resident per SM at this size; raises the kernel's dynamic shared memory limit
// first when it needs more than the default 48 KB. Cached, so graph capture sees no new calls.
template <typename Kernel>
int resident_blocks_per_sm(Kernel kernel, int threads, int smem_bytes) {
    static std::mutex mutex;
    static std::map<std::tuple<const void*, int, int, int>, int> cache;
    int device = 0;
    cudaGetDevice(&device);
    const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), threads, smem_bytes, device);
    std::lock_guard<std::mutex> lock(mutex);
    auto it = cache.find(key);
    if (it == cache.end()) {
        // The limit is one per kernel: set it to the device's maximum (less the kernel's static
        // shared memory), so that a later, smaller size cannot lower it below a size cached here before.
        if (smem_bytes > 48 * 1024) {
            cudaFuncAttributes attributes{};
            cudaFuncGetAttributes(&attributes, kernel);
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 device_limits().smem_optin - (int)attributes.sharedSizeBytes);
        }
        int blocks = 0;
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem_bytes);
        it = cache.emplace(key, blocks < 1 ? 1 : blocks).first;
    }
    return it->second;
}

// Blocks of `kernel` resident on the whole device at once.
template <typename Kernel>
int block_slots(Kernel kernel, int warps_per_block, int smem_bytes) {
    return resident_blocks_per_sm(kernel, warps_per_block * kWarpSize, smem_bytes) * device_limits().sm_count;
}

template <typename Kernel>
dim3 persistent_grid(Kernel kernel, int rows, int warps_per_block, int smem_bytes, int passes) {
    const int wanted = ceil_div(rows, warps_per_block);
    const int resident = block_slots(kernel, warps_per_block, smem_bytes);
    return dim3(wanted < resident ? wanted : resident, passes);
}

// The one-token kernel's grid: all block slots of `max_warps`-warp blocks, each block given just enough
// warps that the rows split into whole rounds, so that every warp walks the same number of rows (but in a
// last round short by less than one row per block) and every SM holds the same number of warps. With
// max_warps per block throughout, the rows' last round (e.g. 896 of 4224 warps for 22016 rows) kept the
// other warps idle: +2.7% end to end at d = 0.5 (docs/perf-notes.md, the 2026-11-23 5b74b01 entry).
struct BalancedGrid {
    dim3 grid;
    int warps_per_block;
};

template <typename Kernel>
BalancedGrid balanced_grid(Kernel kernel, int rows, int max_warps, int smem_bytes, int passes) {
    const int slots = block_slots(kernel, max_warps, smem_bytes);  // blocks given fewer warps keep this count
    const int rounds = ceil_div(rows, slots * max_warps);
    const int warps = ceil_div(ceil_div(rows, rounds), slots);
    const int blocks = ceil_div(rows, warps);
    return {dim3(blocks < slots ? blocks : slots, passes), warps};
}

// The one-token kernel's dynamic shared memory: x as fp32, then (with the norm) its per-vector sums of x^2.
constexpr int64_t one_token_smem_bytes(int cols, bool norm) {
    return (cols + (norm ? vector_count(cols) : 0)) * (int64_t)sizeof(float);
}
// The binding lets a norm or silu_mul through for up to kMackoFusedMaxCols columns; that many must stage
// on every GPU the kernels build for (sm_80 and later opt into at least 99 KB), or the fusion would be lost.
static_assert(one_token_smem_bytes(kMackoFusedMaxCols, true) <= 99 * 1024,
              "the fused one-token kernel's x and sums must fit the smallest opt-in shared memory");

template <typename T, int TT, int STEPS, bool X_IN_SMEM, bool PIPELINE = true>
void launch_spmv_typed(const void* values, const uint8_t* deltas, const int32_t* row_ptr, const void* x, void* out,
                       int rows, int cols, int tokens, bool accumulate, int warps_per_block, cudaStream_t stream) {
    auto kernel = macko_spmv_kernel<T, TT, STEPS, X_IN_SMEM, PIPELINE>;
    const int smem = X_IN_SMEM ? cols * TT * (int)sizeof(T) : 0;
    launch_with_pdl(kernel, persistent_grid(kernel, rows, warps_per_block, smem, ceil_div(tokens, TT)),
                    dim3(warps_per_block * kWarpSize), smem, stream, PIPELINE, static_cast<const uint4*>(values),
                    reinterpret_cast<const uint32_t*>(deltas), row_ptr, static_cast<const uint16_t*>(x),
                    static_cast<T*>(out), rows, cols, tokens, accumulate);
}

// warps_per_block 0: the balanced grid of kDefaultWarpsPerBlock-warp slots (over gate/up pairs with SILU).
template <typename T, int STEPS, bool NORM, bool SILU>
void launch_spmv_one_token(const void* values, const uint8_t* deltas, const int32_t* row_ptr, const void* x,
                           void* out, int rows, int cols, int tokens, bool accumulate, const MackoNorm& norm,
                           int warps_per_block, cudaStream_t stream) {
    auto kernel = macko_spmv_one_token_kernel<T, STEPS, NORM, SILU>;
    const int smem = (int)one_token_smem_bytes(cols, NORM);
    const int walks = SILU ? rows / 2 : rows;  // first rows of the warps' walks
    const BalancedGrid launch =
        warps_per_block > 0 ? BalancedGrid{persistent_grid(kernel, walks, warps_per_block, smem, tokens), warps_per_block}
                            : balanced_grid(kernel, walks, kDefaultWarpsPerBlock, smem, tokens);
    launch_with_pdl(kernel, launch.grid, dim3(launch.warps_per_block * kWarpSize), smem, stream, true,
                    static_cast<const uint4*>(values), reinterpret_cast<const uint32_t*>(deltas), row_ptr,
                    static_cast<const uint16_t*>(x), static_cast<T*>(out), static_cast<const uint16_t*>(norm.weight),
                    norm.eps, rows, cols, accumulate);
}

template <typename T, int STEPS>
void launch_spmv_steps(const void* values, const uint8_t* deltas, const int32_t* row_ptr, const void* x, void* out,
                       int rows, int cols, int tokens, bool accumulate, int tokens_per_pass, bool x_in_smem,
                       int warps_per_block, cudaStream_t stream) {
    const auto args =
        std::make_tuple(values, deltas, row_ptr, x, out, rows, cols, tokens, accumulate, warps_per_block, stream);
    if (!x_in_smem) return std::apply(launch_spmv_typed<T, 1, STEPS, false>, args);
    switch (tokens_per_pass) {  // >= 2: one token with x in shared memory runs launch_spmv_one_token
        case 2: return std::apply(launch_spmv_typed<T, 2, STEPS, true>, args);
        case 4: return std::apply(launch_spmv_typed<T, 4, STEPS, true>, args);
        case 8: return std::apply(launch_spmv_typed<T, 8, STEPS, true>, args);
        default: return std::apply(launch_spmv_typed<T, 16, STEPS, true>, args);
    }
}

template <typename T, int STEPS>
auto one_token_launcher(bool norm, bool silu_mul) {
    if (norm) return silu_mul ? launch_spmv_one_token<T, STEPS, true, true> : launch_spmv_one_token<T, STEPS, true, false>;
    return silu_mul ? launch_spmv_one_token<T, STEPS, false, true> : launch_spmv_one_token<T, STEPS, false, false>;
}

template <typename T>
void launch_spmv_dtype(const void* values, const uint8_t* deltas, const int32_t* row_ptr, const void* x, void* out,
                       int rows, int cols, int tokens, bool accumulate, const MackoNorm& norm, bool silu_mul,
                       const MackoTuning& tuning, cudaStream_t stream) {
    const int smem_optin = device_limits().smem_optin;
    // Tokens per pass: all of them (up to 16) when their x fits in shared memory, so the weights
    // are read once; one token per pass with fp32 x otherwise.
    int per_pass = 1;
    while (per_pass < tokens && per_pass < 16) per_pass *= 2;
    while (per_pass > 1 && (int64_t)cols * per_pass * (int64_t)sizeof(T) > smem_optin) per_pass /= 2;
    const bool x_in_smem =
        tuning.x_in_smem != 0 && (per_pass > 1 || one_token_smem_bytes(cols, norm.weight != nullptr) <= smem_optin);
    if (!x_in_smem) per_pass = 1;  // the global-x path takes one token per pass
    const int steps = tuning.steps > 0 ? tuning.steps : kDefaultSteps;
    // Several tokens per pass need large x tiles (few blocks per SM): give those blocks more warps.
    const int warps = tuning.warps_per_block > 0 ? tuning.warps_per_block
                      : per_pass > 1             ? kMaxThreads / kWarpSize
                                                 : kDefaultWarpsPerBlock;
    if (tuning.pipeline == 0)  // the reference kernel's schedule: one step, x from global, no prefetch
        return launch_spmv_typed<T, 1, 1, false, false>(values, deltas, row_ptr, x, out, rows, cols, tokens,
                                                        accumulate, warps, stream);
    if (x_in_smem && per_pass == 1) {  // the only path a norm or silu_mul takes (the binding checks that it does)
        auto one_token = steps == 1 ? one_token_launcher<T, 1>(norm.weight != nullptr, silu_mul)
                                    : one_token_launcher<T, 2>(norm.weight != nullptr, silu_mul);
        return one_token(values, deltas, row_ptr, x, out, rows, cols, tokens, accumulate, norm,
                         tuning.warps_per_block, stream);
    }
    auto launch = steps == 1 ? launch_spmv_steps<T, 1> : launch_spmv_steps<T, 2>;
    launch(values, deltas, row_ptr, x, out, rows, cols, tokens, accumulate, per_pass, x_in_smem, warps, stream);
}

}  // namespace

void launch_macko_spmv(const void* values, const uint8_t* deltas, const int32_t* row_ptr, const void* x,
                       void* out, int64_t rows, int64_t cols, int64_t tokens, bool accumulate,
                       const MackoNorm& norm, bool silu_mul, DType dtype, const MackoTuning& tuning,
                       cudaStream_t stream) {
    if (rows == 0 || tokens == 0) return;
    switch (dtype) {
        case DType::kFloat16:
            launch_spmv_dtype<half>(values, deltas, row_ptr, x, out, (int)rows, (int)cols, (int)tokens, accumulate,
                                    norm, silu_mul, tuning, stream);
            break;
        case DType::kBFloat16:
            launch_spmv_dtype<__nv_bfloat16>(values, deltas, row_ptr, x, out, (int)rows, (int)cols, (int)tokens,
                                             accumulate, norm, silu_mul, tuning, stream);
            break;
        case DType::kFloat32: break;  // rejected by the binding
    }
}

void launch_macko_decompress(const void* values, const uint8_t* deltas, const int32_t* row_ptr, void* out,
                             int64_t rows, int64_t cols, DType, cudaStream_t stream) {
    if (rows == 0) return;
    const int row_bytes = (int)(((cols + 7) & ~7) * sizeof(uint16_t));
    const int fit = device_limits().smem_optin / row_bytes;
    const auto args = std::make_tuple(static_cast<const uint4*>(values), reinterpret_cast<const uint32_t*>(deltas),
                                      row_ptr, static_cast<uint16_t*>(out), (int)rows, (int)cols);
    if (fit >= 1) {
        const int warps = fit < kDecompressWarpsPerBlock ? fit : kDecompressWarpsPerBlock;
        auto kernel = macko_decompress_kernel<kDefaultSteps, true>;
        const dim3 grid = persistent_grid(kernel, (int)rows, warps, warps * row_bytes, 1);
        std::apply([&](auto... a) { kernel<<<grid, warps * kWarpSize, warps * row_bytes, stream>>>(a...); }, args);
    } else {
        auto kernel = macko_decompress_kernel<kDefaultSteps, false>;
        const dim3 grid = persistent_grid(kernel, (int)rows, kDecompressWarpsPerBlock, 0, 1);
        std::apply([&](auto... a) { kernel<<<grid, kDecompressWarpsPerBlock * kWarpSize, 0, stream>>>(a...); }, args);
    }
}

}  // namespace minfer
