// Block transposes (ksmm.h, launch_ksmm_transpose_blocks): the permutation between a KS factor's natural order and
// its batch-major order as one pass of 16-byte loads and stores.
// A transposed block is [short][long] on one side and [long][short] on the other, long a multiple of 8 (b or c),
// short the factor's d. A thread block stages `short` x `tile_long` elements (or whole blocks when they are small)
// in shared memory as rows of the long side: on the side stored long-major the rows are whole 16-byte runs, and on
// the side stored short-major the tile is one contiguous run, moved in 16-byte pieces whose 8 elements are
// gathered from or scattered to the staged rows.
#include <algorithm>

#include "ksmm/ksmm.h"

namespace minfer {

namespace {

constexpr int kTileElements = 8192;  // 16 KB of 16-bit values a block
constexpr int kThreads = 256;
constexpr int kPieces = kTileElements / 8 / kThreads;  // 16-byte pieces a thread moves each way
constexpr int kPitchPad = 8;  // elements after each staged row: rows start on distinct banks, pieces stay aligned

struct Tile {
    int blocks;  // whole blocks a tile (1 unless a block has at most half a tile of elements)
    int width;   // long elements a tile, a multiple of 8
};

struct Shape {
    int64_t blocks;
    int short_len, long_len;
    Tile tile;
    int64_t tiles_long;  // tiles along one block's long side
};

__device__ __forceinline__ uint4 load_16B(const uint16_t* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ void store_16B(uint16_t* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

// kLongMajorIn: in [blocks][short][long] -> out [blocks][long][short]; else in [blocks][long][short] -> out
// [blocks][short][long].
template <bool kLongMajorIn>
__global__ void __launch_bounds__(kThreads) transpose_blocks_kernel(const uint16_t* __restrict__ in,
                                                                    uint16_t* __restrict__ out, Shape shape) {
    extern __shared__ __align__(16) uint16_t staged[];  // [blocks * short][width + kPitchPad]
    const int S = shape.short_len, L = shape.long_len, width_max = shape.tile.width;
    const int pitch = width_max + kPitchPad;
    const int64_t first = blockIdx.x / shape.tiles_long * shape.tile.blocks;
    const int long0 = static_cast<int>(blockIdx.x % shape.tiles_long) * width_max;
    const int blocks = static_cast<int>(min(static_cast<int64_t>(shape.tile.blocks), shape.blocks - first));
    const int width = min(width_max, L - long0);
    const int64_t block_elements = static_cast<int64_t>(S) * L;
    const int row_pieces = width / 8, rows = blocks * S, pieces = rows * row_pieces;

    // The long-major side: piece p is 8 long elements of staged row p / row_pieces (block m, short index s).
    auto long_major_global = [&](uint16_t* base, int p) {
        const int row = p / row_pieces, m = row / S, s = row % S;
        return base + (first + m) * block_elements + static_cast<int64_t>(s) * L + long0 + (p % row_pieces) * 8;
    };
    auto long_major_staged = [&](int p) { return staged + (p / row_pieces) * pitch + (p % row_pieces) * 8; };
    // The short-major side: the tile's elements (m, l, s) at m * L * S + (long0 + l) * S + s, contiguous because a
    // tile of several blocks holds them whole; piece p is elements 8p .. 8p + 7 of that run.
    const int64_t run_start = first * block_elements + static_cast<int64_t>(long0) * S;
    const int per_block = width * S;
    // The staged positions of run elements 8p .. 8p + 7: one division for the piece, then steps along s.
    auto staged_positions = [&](int p, int (&at)[8]) {
        const int e = 8 * p, m = e / per_block, rest = e % per_block;
        int row = m * S + rest % S, l = rest / S, s = rest % S;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            at[k] = row * pitch + l;
            ++row;
            if (++s == S) {  // next long element; past the block's width, the next block's first
                s = 0, row -= S;
                if (++l == width) l = 0, row += S;
            }
        }
    };

    // f(i, p) for this thread's pieces p, i-th of kPieces; unrolled, so held[i] stays in registers.
    auto each_piece = [&](auto&& f) {
#pragma unroll
        for (int i = 0; i < kPieces; ++i) {
            const int p = threadIdx.x + i * kThreads;
            if (p < pieces) f(i, p);
        }
    };
    uint4 held[kPieces];
    if constexpr (kLongMajorIn) {
        each_piece([&](int i, int p) { held[i] = load_16B(long_major_global(const_cast<uint16_t*>(in), p)); });
        each_piece([&](int i, int p) { store_16B(long_major_staged(p), held[i]); });
        __syncthreads();
        each_piece([&](int, int p) {
            int at[8];
            staged_positions(p, at);
            uint16_t v[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = staged[at[k]];
            store_16B(out + run_start + 8 * p, *reinterpret_cast<const uint4*>(v));
        });
    } else {
        each_piece([&](int i, int p) { held[i] = load_16B(in + run_start + 8 * p); });
        each_piece([&](int i, int p) {
            int at[8];
            staged_positions(p, at);
            const uint16_t* v = reinterpret_cast<const uint16_t*>(&held[i]);
#pragma unroll
            for (int k = 0; k < 8; ++k) staged[at[k]] = v[k];
        });
        __syncthreads();
        each_piece([&](int, int p) { store_16B(long_major_global(out, p), load_16B(long_major_staged(p))); });
    }
}

}  // namespace

bool ksmm_transpose_blocks_supports(int64_t rows, int64_t cols, const void* in, const void* out) {
    const int64_t long_len = rows % 8 == 0 && (cols % 8 != 0 || rows >= cols) ? rows : cols;
    const int64_t short_len = long_len == rows ? cols : rows;
    return long_len % 8 == 0 && short_len * 8 <= kTileElements && long_len <= INT32_MAX &&
           reinterpret_cast<uintptr_t>(in) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
}

void launch_ksmm_transpose_blocks(const void* in, void* out, int64_t matrices, int64_t rows, int64_t cols,
                                  cudaStream_t stream) {
    if (matrices == 0 || rows == 0 || cols == 0) return;
    // in [rows][cols] -> out [cols][rows]: long-major input when the long side is cols
    const bool long_major_in = !(rows % 8 == 0 && (cols % 8 != 0 || rows >= cols));
    Shape shape{matrices, static_cast<int>(long_major_in ? rows : cols), static_cast<int>(long_major_in ? cols : rows),
                {1, 0}, 0};
    const int64_t block_elements = rows * cols;
    if (block_elements * 2 <= kTileElements) {
        shape.tile = {static_cast<int>(kTileElements / block_elements), shape.long_len};
    } else {
        const int fit = kTileElements / shape.short_len / 8 * 8;
        shape.tile = {1, static_cast<int>(std::min<int64_t>(fit, shape.long_len))};
    }
    shape.tiles_long = (shape.long_len + shape.tile.width - 1) / shape.tile.width;
    const int64_t groups = (matrices + shape.tile.blocks - 1) / shape.tile.blocks;
    const size_t smem = static_cast<size_t>(shape.tile.blocks) * shape.short_len * (shape.tile.width + kPitchPad) * 2;
    const unsigned grid = static_cast<unsigned>(groups * shape.tiles_long);
    const auto* src = static_cast<const uint16_t*>(in);
    auto* dst = static_cast<uint16_t*>(out);
    if (long_major_in)  // smem <= 2 x kTileElements x 2 bytes: under the 48 KB default
        transpose_blocks_kernel<true><<<grid, kThreads, smem, stream>>>(src, dst, shape);
    else
        transpose_blocks_kernel<false><<<grid, kThreads, smem, stream>>>(src, dst, shape);
}

}  // namespace minfer
