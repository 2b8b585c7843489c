// MACKO-16-4 SpMM on the tensor cores, for 9-16 tokens (batched decode, speculative verification).
//
// The CUDA-core SpMM (macko_spmv.cu) costs each stored entry T FMAs and T / 8 shared loads; past 8
// tokens it loses to dense cuBLAS (docs/perf-notes.md, the 2026-11-23 247b35e entry). Here each entry costs one 2-byte
// shared store: a block takes kMackoTileRows rows and walks them window by window (kMackoWindowCols
// columns). In each window every warp scatters the runs of its rows into a dense tile in shared memory
// (the window table says where each row's run starts, on a whole chunk, so runs are walked like rows and
// a run's last chunk may spill past the window), then the 16 warps multiply the tile with the window of
// x (mma.sync m16n8k16: M = 16 tokens, N = 8 tile rows, K = 16 columns; warp w takes rows 8 (w % 4)..
// and quarter w / 4 of the window), clear what they read and move the spill to the tile's start. Rows
// too few to fill the GPU are split over k_splits shares of the windows; the last block of a tile adds
// the shares.
#include <mutex>

#include "macko.h"
#include "macko_walk.cuh"

namespace minfer {

namespace {

constexpr int kTcWarps = 16;
constexpr int kTcThreads = kTcWarps * kWarpSize;
constexpr int kRowsPerWarp = kMackoTileRows / kTcWarps;
// Runs of one window are ~1 step at d = 0.3-0.5 (docs/perf-notes.md, the 2026-11-24 f75d07b entry).
constexpr int kDefaultTcSteps = 1;
constexpr int kNTiles = kMackoTileRows / 8;             // mma N = 8 rows
constexpr int kWindowParts = kTcWarps / kNTiles;        // warps sharing one n-tile split the window
constexpr int kPartCols = kMackoWindowCols / kWindowParts;
// A run ends on a whole chunk, so its last chunk may reach up to 7 entries (112 columns) into the next
// window: the tile keeps those columns past the window and moves them to its start for the next one.
constexpr int kSpillCols = 128;
constexpr int kTileStride = kMackoWindowCols + kSpillCols + 8;  // elements per tile row: rows 16 B apart mod 128
constexpr int kXStride = kMackoWindowCols + 8;
constexpr int kTokens = kMackoTensorCoreTokens;
constexpr int kOriginBias = 15;  // the window table's origin field: origin + 15 in 7 bits
static_assert(kMackoTileRows % kTcWarps == 0 && kTcWarps % kNTiles == 0 && kPartCols % 32 == 0, "tile split");

constexpr int kTileBytes = kMackoTileRows * kTileStride * 2;
constexpr int kXBytes = kTokens * kXStride * 2;
constexpr int kPartSumsBytes = (kWindowParts - 1) * kNTiles * kWarpSize * 4 * (int)sizeof(float);
constexpr int kTcSmemBytes = kTileBytes + kXBytes + kPartSumsBytes;
static_assert(kSpillCols <= kPartCols, "part 0 moves the spill into its own columns");

// The runs one block walks: rows row0 + i * kTcWarps + warp (i < kRowsPerWarp) in windows
// w_begin.. (run k: window w_begin + k / kRowsPerWarp, row i = k % kRowsPerWarp). Rows past the
// matrix give empty runs, so every warp of the block reaches the same window ends.
template <int STEPS>
struct WindowRuns {
    const int* __restrict__ row_ptr;
    const int* __restrict__ window_table;
    int rows, windows, first_row, w_begin, run_count;
    int next_s = 0, next_e = 0, next_origin = 0, origin = 0;

    __device__ __forceinline__ int end() const { return run_count; }
    __device__ __forceinline__ int run_origin() const { return origin; }

    __device__ __forceinline__ void read_next(int k) {
        next_s = next_e = next_origin = 0;
        const int row = first_row + (k % kRowsPerWarp) * kTcWarps;
        if (k >= run_count || row >= rows) return;
        const int w = w_begin + k / kRowsPerWarp;
        const int start = row_ptr[row];
        const int* bounds = window_table + (int64_t)row * (windows - 1);
        next_s = start;
        if (w > 0) {
            const int b = bounds[w - 1];
            next_s = start + (b >> 7);
            next_origin = (b & 127) - kOriginBias;
        }
        next_e = w + 1 < windows ? start + (bounds[w] >> 7) : row_ptr[row + 1];
    }

    __device__ __forceinline__ GroupCursor enter(int k) {
        origin = next_origin;
        const GroupCursor c{k, next_s, next_e, next_s & ~(kChunk - 1)};
        read_next(k + 1);
        return c;
    }

    __device__ __forceinline__ GroupCursor first(int k) {
        read_next(k);
        return enter(k);
    }

    __device__ __forceinline__ GroupCursor after(const GroupCursor& c) {
        const GroupCursor n{c.row, c.s, c.e, c.a + STEPS * kStep};
        return n.a < c.e ? n : enter(c.row + 1);
    }
};

// The block's shared memory (at a fixed symbol, so that its parts cost no registers): the tile
// [kMackoTileRows][kTileStride], zero outside the entries of the current window and its spill; x's window
// [kTokens][kXStride] (rows past `tokens` zero); the accumulators of warps kNTiles.. for the final sum.
extern __shared__ __align__(16) unsigned char tc_smem[];
__device__ __forceinline__ uint16_t* tile_rows() { return reinterpret_cast<uint16_t*>(tc_smem); }
__device__ __forceinline__ uint16_t* x_window() { return reinterpret_cast<uint16_t*>(tc_smem + kTileBytes); }
__device__ __forceinline__ float4* part_sums() { return reinterpret_cast<float4*>(tc_smem + kTileBytes + kXBytes); }

template <typename T>
struct TileConsumer {
    const uint16_t* x;
    int cols, tokens, w_begin, w_end;
    int row_offset = 0;  // the current run's tile row, in elements
    float acc[4] = {0.f, 0.f, 0.f, 0.f};

    // x's window w: 16-byte asynchronous copies (zeros past the last column), waited for before the
    // window's product; element by element when x's rows are not in 16-byte vectors.
    __device__ __forceinline__ void stage_window(int w) {
        uint16_t* dst = x_window();
        const int c0 = w * kMackoWindowCols;
        if (cols % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
            constexpr int kVectors = kMackoWindowCols / 8;
            for (int i = threadIdx.x; i < tokens * kVectors; i += kTcThreads) {
                const int t = i / kVectors, col = c0 + (i % kVectors) * 8;
                cp_async_16(smem_addr(dst + t * kXStride + (i % kVectors) * 8), x + (int64_t)t * cols + min(col, cols - 8),
                            col < cols);
            }
            cp_async_commit();
        } else {
            for (int i = threadIdx.x; i < tokens * kMackoWindowCols; i += kTcThreads) {
                const int t = i / kMackoWindowCols, col = c0 + i % kMackoWindowCols;
                dst[t * kXStride + i % kMackoWindowCols] =
                    col < cols ? (uint16_t)load_coherent_u16(x + (int64_t)t * cols + col) : (uint16_t)0;
            }
        }
    }

    // The tile and the token rows past `tokens` start at zero; x's first window is staged.
    __device__ __forceinline__ void stage() {
        allow_dependents_to_launch();
        const uint4 zero = make_uint4(0, 0, 0, 0);
        for (int i = threadIdx.x; i < kTileBytes / 16; i += kTcThreads) reinterpret_cast<uint4*>(tile_rows())[i] = zero;
        uint4* rows_past = reinterpret_cast<uint4*>(x_window() + tokens * kXStride);
        for (int i = threadIdx.x; i < (kTokens - tokens) * kXStride / 8; i += kTcThreads) rows_past[i] = zero;
        wait_for_previous_kernel();
        if (w_begin < w_end) stage_window(w_begin);
        cp_async_wait<0>();
        __syncthreads();
    }

    __device__ __forceinline__ void begin_row(int k) {
        row_offset = ((k % kRowsPerWarp) * kTcWarps + (int)threadIdx.x / kWarpSize) * kTileStride;
    }

    // Per entry: a byte permute (its prefix), one address add and a 2-byte shared store whose immediate
    // carries the entry's offset j.
    template <bool CHECK>
    __device__ __forceinline__ void chunk(const uint4& v, const ChunkNibbles& nib, int base, int c0, int s, int e) {
        uint32_t at = smem_addr(tile_rows() + row_offset + base);
        asm("mov.b32 %0, %0;" : "+r"(at));  // keeps the chunk's address whole (see chunk_dot in macko_spmv.cu)
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
            if (CHECK && (c0 + j < s || c0 + j >= e)) continue;
            const uint32_t prefix = __byte_perm(j & 1 ? nib.odd : nib.even, 0, 0x4440 + (j >> 1));
            const uint32_t w = word_of(v, j >> 1);
            const unsigned short bits = (unsigned short)((j & 1) ? (w >> 16) : w);
            asm volatile("st.shared.u16 [%0], %1;" ::"r"(at + 2 * prefix + 2 * j), "h"(bits));
        }
    }

    __device__ __forceinline__ void end_row(int k) {
        if (k % kRowsPerWarp == kRowsPerWarp - 1) window_done(w_begin + k / kRowsPerWarp);
    }

    // acc += x's window columns [c0, c0 + COLS) times the warp's n-tile of the tile, same columns.
    template <int COLS>
    __device__ __forceinline__ void multiply(int c0) {
        const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
        // ldmatrix rows: A (x) lane l -> token l % 16 (l & 7, + 8 for lanes 8-15 and 24-31), columns + 8 from lane 16;
        // B (tile) lane l -> tile row l & 7 of the n-tile, columns + 8 (l / 8).
        const uint32_t a_addr =
            smem_addr(x_window() + ((lane & 7) + ((lane >> 3) & 1) * 8) * kXStride + (lane >> 4) * 8 + c0);
        const uint32_t b_addr =
            smem_addr(tile_rows() + ((warp % kNTiles) * 8 + (lane & 7)) * kTileStride + (lane >> 3) * 8 + c0);
#pragma unroll
        for (int k = 0; k < COLS / 32; ++k) {  // two k-blocks of 16 columns per B load
            uint32_t a[4], b[4];
            ldmatrix_x4(b, b_addr + k * 64);
            ldmatrix_x4(a, a_addr + k * 64);
            mma_m16n8k16<T>(acc, a, b[0], b[1]);
            ldmatrix_x4(a, a_addr + k * 64 + 32);
            mma_m16n8k16<T>(acc, a, b[2], b[3]);
        }
    }

    // Every warp has scattered its runs of window w: multiply, clear what was read, stage the next window.
    // The runs of a share's last window may spill into the next share's first one: that share's runs
    // start past the spill, so this block multiplies it with that window's x.
    __device__ __forceinline__ void window_done(int w) {
        cp_async_wait<0>();  // this thread's copies of x's window w
        __syncthreads();     // the window's runs are in the tile, x's window is staged
        const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
        const int n_tile = warp % kNTiles, part = warp / kNTiles;
        multiply<kPartCols>(part * kPartCols);
        __syncwarp();  // every lane's ldmatrix has read the rows before any lane clears them
        // The warp's 8 rows, 16-byte vectors: part 0 moves the spill to the row start and clears the
        // rest of its columns and the spill; the other parts clear their columns.
        uint4* rows = reinterpret_cast<uint4*>(tile_rows() + n_tile * 8 * kTileStride);
        constexpr int kRowVectors = kTileStride / 8, kSpillVectors = kSpillCols / 8, kPartVectors = kPartCols / 8;
        const uint4 zero = make_uint4(0, 0, 0, 0);
        if (part == 0) {
            for (int i = lane; i < 8 * kSpillVectors; i += kWarpSize) {
                uint4* row = rows + (i / kSpillVectors) * kRowVectors;
                const int v = i % kSpillVectors;
                row[v] = row[kMackoWindowCols / 8 + v];
                row[kMackoWindowCols / 8 + v] = zero;
            }
            for (int i = lane; i < 8 * (kPartVectors - kSpillVectors); i += kWarpSize)
                rows[(i / (kPartVectors - kSpillVectors)) * kRowVectors + kSpillVectors + i % (kPartVectors - kSpillVectors)] = zero;
        } else {
            for (int i = lane; i < 8 * kPartVectors; i += kWarpSize)
                rows[(i / kPartVectors) * kRowVectors + part * kPartVectors + i % kPartVectors] = zero;
        }
        __syncthreads();
        if (w + 1 >= (cols + kMackoWindowCols - 1) / kMackoWindowCols) return;
        stage_window(w + 1);  // nobody reads x until the next window's product
        if (w + 1 < w_end) return;
        cp_async_wait<0>();
        __syncthreads();
        if (part == 0) multiply<kSpillCols>(0);
    }
};

template <typename T, int STEPS>
__global__ void __launch_bounds__(kTcThreads, 2)
    macko_tensor_core_spmm_kernel(const uint4* __restrict__ values, const uint32_t* __restrict__ deltas,
                                  const int* __restrict__ row_ptr, const int* __restrict__ window_table,
                                  const uint16_t* x, T* out, float* partials, int* counters, int rows, int cols,
                                  int tokens, bool accumulate) {
    __shared__ bool block_is_last;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int windows = (cols + kMackoWindowCols - 1) / kMackoWindowCols;
    const int splits = gridDim.y, per_split = (windows + splits - 1) / splits;
    const int w_begin = min(windows, (int)blockIdx.y * per_split), w_end = min(windows, w_begin + per_split);
    const int row0 = blockIdx.x * kMackoTileRows;

    TileConsumer<T> consumer{x, cols, tokens, w_begin, w_end};
    WindowRuns<STEPS> runs{row_ptr, window_table, rows, windows, row0 + warp, w_begin,
                              (w_end - w_begin) * kRowsPerWarp};
    walk_groups<STEPS>(values, deltas, runs, runs.end(), 0, lane, consumer);

    // The warps of one n-tile hold sums over different parts of every window: add them.
    const int n_tile = warp % kNTiles;
    float4* mine = part_sums() + (n_tile * kWarpSize + lane);
    if (warp >= kNTiles) mine[(warp / kNTiles - 1) * kNTiles * kWarpSize] =
        make_float4(consumer.acc[0], consumer.acc[1], consumer.acc[2], consumer.acc[3]);
    __syncthreads();
    // Accumulator c (c0, c1: token lane / 4, tile rows n, n + 1; c2, c3: token + 8) with n = 2 (lane % 4).
    const int token = lane / 4, tile_row = n_tile * 8 + 2 * (lane % 4);
    const int64_t padded_rows = (int64_t)gridDim.x * kMackoTileRows;
    if (warp < kNTiles) {
        float c[4] = {consumer.acc[0], consumer.acc[1], consumer.acc[2], consumer.acc[3]};
        for (int h = 1; h < kWindowParts; ++h) {
            const float4 o = mine[(h - 1) * kNTiles * kWarpSize];
            c[0] += o.x;
            c[1] += o.y;
            c[2] += o.z;
            c[3] += o.w;
        }
        if (splits > 1) {
            float* share = partials + ((int64_t)blockIdx.y * kTokens + token) * padded_rows + row0 + tile_row;
            *reinterpret_cast<float2*>(share) = make_float2(c[0], c[1]);
            *reinterpret_cast<float2*>(share + 8 * padded_rows) = make_float2(c[2], c[3]);
        } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int t = token + (i >> 1) * 8, row = row0 + tile_row + (i & 1);
                if (t < tokens && row < rows) {
                    T* dst = out + (int64_t)t * rows + row;
                    *dst = from_float<T>(c[i] + (accumulate ? to_float(*dst) : 0.f));
                }
            }
        }
    }
    if (splits == 1) return;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) block_is_last = atomicAdd(&counters[blockIdx.x], 1) == splits - 1;
    __syncthreads();
    if (!block_is_last) return;
    __threadfence();
    for (int i = threadIdx.x; i < tokens * kMackoTileRows; i += kTcThreads) {
        const int t = i / kMackoTileRows, row = row0 + i % kMackoTileRows;
        if (row >= rows) continue;
        float sum = 0.f;
        for (int s = 0; s < splits; ++s) sum += __ldcg(partials + ((int64_t)s * kTokens + t) * padded_rows + row);
        T* dst = out + (int64_t)t * rows + row;
        *dst = from_float<T>(sum + (accumulate ? to_float(*dst) : 0.f));
    }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // at rest again for the next launch
}

template <typename T, int STEPS>
void launch_typed(const void* values, const uint8_t* deltas, const int32_t* row_ptr, const int32_t* window_table,
                  const void* x, void* out, float* partials, int32_t* counters, int rows, int cols, int tokens,
                  int k_splits, bool accumulate, cudaStream_t stream) {
    auto kernel = macko_tensor_core_spmm_kernel<T, STEPS>;
    static std::once_flag configured[64];  // per device: the opt-in above 48 KB of shared memory
    int device = 0;
    cudaGetDevice(&device);
    std::call_once(configured[device % 64], [&] {
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kTcSmemBytes);
    });
    const dim3 grid((rows + kMackoTileRows - 1) / kMackoTileRows, k_splits);
    launch_with_pdl(kernel, grid, dim3(kTcThreads), kTcSmemBytes, stream, true, static_cast<const uint4*>(values),
                    reinterpret_cast<const uint32_t*>(deltas), row_ptr, window_table,
                    static_cast<const uint16_t*>(x), static_cast<T*>(out), partials, counters, rows, cols, tokens,
                    accumulate);
}

}  // namespace

void launch_macko_tensor_core_spmm(const void* values, const uint8_t* deltas, const int32_t* row_ptr,
                                   const int32_t* window_table, const void* x, void* out, float* partials,
                                   int32_t* counters, int64_t rows, int64_t cols, int64_t tokens, int k_splits,
                                   int steps, bool accumulate, DType dtype, cudaStream_t stream) {
    if (rows == 0 || tokens == 0) return;
    if (steps == 0) steps = kDefaultTcSteps;
    const bool bf16 = dtype == DType::kBFloat16;
    const auto launch = steps == 1 ? (bf16 ? launch_typed<__nv_bfloat16, 1> : launch_typed<half, 1>)
                                   : (bf16 ? launch_typed<__nv_bfloat16, 2> : launch_typed<half, 2>);
    launch(values, deltas, row_ptr, window_table, x, out, partials, counters, (int)rows, (int)cols, (int)tokens,
           k_splits, accumulate, stream);
}

}  // namespace minfer
