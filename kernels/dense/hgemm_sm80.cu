// HGEMM on sm_80+ (A100, RTX 30xx/40xx, and Hopper when pinned): mma.sync m16n8k16 on the tensor
// cores, a 3-stage cp.async pipeline, and XOR-swizzled shared memory read through ldmatrix.
// One CTA computes one BM x BN output tile; each warp a (BM / WARPS_M) x (BN / WARPS_N) piece.
#include <type_traits>

#include "hgemm.h"
#include "common/device_utils.cuh"
#include "hgemm_common.cuh"

namespace minfer {

namespace {

constexpr int kBK = 64;      // K per stage: each tile row is one 128-byte line of shared memory
constexpr int kStages = 3;   // 3 x 48 KB fits the 99 KB a block may take on sm_86/sm_89
constexpr int kBand = 8;     // tile rows per band in the tile order (hgemm_common.cuh)

template <int BM, int BN, int WARPS_M, int WARPS_N>
struct Sm80Tile {
    static constexpr int kThreads = WARPS_M * WARPS_N * 32;
    static constexpr int kWarpM = BM / WARPS_M;
    static constexpr int kWarpN = BN / WARPS_N;
    static constexpr int kFragsM = kWarpM / 16;  // m16 fragments per warp
    static constexpr int kFragsN = kWarpN / 8;   // n8 fragments per warp
    static constexpr int kStageBytes = (BM + BN) * kBK * 2;
    static constexpr int kSmemBytes = kStages * kStageBytes;
    static_assert(kFragsN % 2 == 0, "B fragments are loaded two n8 blocks at a time");
};

// Byte offset of 16-byte chunk `chunk` (0..7) of tile row `row`. The chunk index is XORed with the
// row, so the 8 rows one ldmatrix phase reads fall in 8 different bank groups.
__device__ __forceinline__ uint32_t swizzled(int row, int chunk) {
    return row * 128 + ((chunk ^ (row & 7)) << 4);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (std::is_same_v<T, half>) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Copies rows [row0, row0 + ROWS) x columns [k0, k0 + 64) of a row-major [rows_total, K] matrix
// into a swizzled stage; 16-byte chunks past the matrix edge are zero-filled.
template <int ROWS, int THREADS, typename T>
__device__ __forceinline__ void load_rows(uint32_t stage, const T* src, int row0, int rows_total, int k0, int K,
                                          int tid) {
    static_assert(ROWS * 8 % THREADS == 0, "whole chunks per thread");
#pragma unroll
    for (int i = 0; i < ROWS * 8 / THREADS; ++i) {
        const int c = i * THREADS + tid;
        const int row = c >> 3, chunk = c & 7;
        const int g_row = row0 + row, g_k = k0 + chunk * 8;
        const bool valid = g_row < rows_total && g_k < K;
        cp_async_16(stage + swizzled(row, chunk), valid ? src + (int64_t)g_row * K + g_k : src, valid);
    }
}

#endif  // __CUDA_ARCH__ >= 800

template <typename T, int BM, int BN, int WARPS_M, int WARPS_N>
__global__ void __launch_bounds__(WARPS_M* WARPS_N * 32)
    hgemm_sm80_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int M, int N, int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    using Tile = Sm80Tile<BM, BN, WARPS_M, WARPS_N>;
    extern __shared__ __align__(128) uint8_t smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
    const TileCoord tile = tile_coord(blockIdx.x, (M + BM - 1) / BM, (N + BN - 1) / BN, kBand);
    const int m0 = tile.m * BM, n0 = tile.n * BN;
    const uint32_t base = shared_address(smem);
    auto stage_a = [&](int s) { return base + s * Tile::kStageBytes; };
    auto stage_b = [&](int s) { return base + s * Tile::kStageBytes + BM * 128; };
    auto load_stage = [&](int s, int kt) {
        load_rows<BM, Tile::kThreads>(stage_a(s), x, m0, M, kt * kBK, K, tid);
        load_rows<BN, Tile::kThreads>(stage_b(s), w, n0, N, kt * kBK, K, tid);
    };

    float acc[Tile::kFragsM][Tile::kFragsN][4] = {};
    const int num_k = (K + kBK - 1) / kBK;
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < num_k) load_stage(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < num_k; ++kt) {
        cp_async_wait<kStages - 2>();  // stage kt has landed (for this thread) ...
        __syncthreads();               // ... for every thread, and stage kt - 1 is no longer read
        const int next = kt + kStages - 1;
        if (next < num_k) load_stage(next % kStages, next);
        cp_async_commit();

        const uint32_t a_stage = stage_a(kt % kStages), b_stage = stage_b(kt % kStages);
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
            uint32_t a[Tile::kFragsM][4];
            uint32_t b[Tile::kFragsN][2];
#pragma unroll
            for (int i = 0; i < Tile::kFragsM; ++i) {
                // lanes 0-15 address rows 0-15 at k 0-7, lanes 16-31 the same rows at k 8-15
                const int row = warp_m * Tile::kWarpM + i * 16 + (lane & 15);
                ldmatrix_x4(a[i], a_stage + swizzled(row, kk * 2 + (lane >> 4)));
            }
#pragma unroll
            for (int j = 0; j < Tile::kFragsN; j += 2) {
                // matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
                const int row = warp_n * Tile::kWarpN + j * 8 + (lane & 7) + ((lane >> 4) << 3);
                uint32_t r[4];
                ldmatrix_x4(r, b_stage + swizzled(row, kk * 2 + ((lane >> 3) & 1)));
                b[j][0] = r[0];
                b[j][1] = r[1];
                b[j + 1][0] = r[2];
                b[j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < Tile::kFragsM; ++i)
#pragma unroll
                for (int j = 0; j < Tile::kFragsN; ++j) mma_16816<T>(acc[i][j], a[i], b[j][0], b[j][1]);
        }
    }
    cp_async_wait<0>();

    // Accumulator fragment: rows lane/4 and lane/4 + 8, columns 2 * (lane % 4) + {0, 1}.
#pragma unroll
    for (int i = 0; i < Tile::kFragsM; ++i) {
        const int row = m0 + warp_m * Tile::kWarpM + i * 16 + (lane >> 2);
#pragma unroll
        for (int j = 0; j < Tile::kFragsN; ++j) {
            const int col = n0 + warp_n * Tile::kWarpN + j * 8 + (lane & 3) * 2;
            if (col >= N) continue;
            if (row < M)
                *reinterpret_cast<uint32_t*>(y + (int64_t)row * N + col) = pack2<T>(acc[i][j][0], acc[i][j][1]);
            if (row + 8 < M)
                *reinterpret_cast<uint32_t*>(y + (int64_t)(row + 8) * N + col) =
                    pack2<T>(acc[i][j][2], acc[i][j][3]);
        }
    }
#endif
}

template <typename T, int BM, int BN, int WARPS_M, int WARPS_N>
const char* launch_tile(const void* x, const void* w, void* y, int m, int n, int k, cudaStream_t stream) {
    using Tile = Sm80Tile<BM, BN, WARPS_M, WARPS_N>;
    constexpr auto kernel = hgemm_sm80_kernel<T, BM, BN, WARPS_M, WARPS_N>;
    if (!opt_in_shared_memory<kernel>(Tile::kSmemBytes))
        return "this GPU cannot give the sm80 HGEMM kernel the shared memory it needs";
    const int tiles = ((m + BM - 1) / BM) * ((n + BN - 1) / BN);
    kernel<<<tiles, Tile::kThreads, Tile::kSmemBytes, stream>>>(static_cast<const T*>(x), static_cast<const T*>(w),
                                                                 static_cast<T*>(y), m, n, k);
    return nullptr;
}

template <typename T>
const char* launch_typed(const void* x, const void* w, void* y, int m, int n, int k, int tile_m,
                         cudaStream_t stream) {
    if (tile_m == 0) tile_m = m <= 64 ? 64 : 128;  // few tokens: half the rows, twice the tiles
    switch (tile_m) {
        case 64: return launch_tile<T, 64, 128, 1, 4>(x, w, y, m, n, k, stream);
        case 128: return launch_tile<T, 128, 128, 2, 2>(x, w, y, m, n, k, stream);
        default: return "unknown sm80 HGEMM tile";
    }
}

}  // namespace

const char* launch_hgemm_sm80(const void* x, const void* w, void* y, int m, int n, int k, DType dtype, int tile_m,
                              cudaStream_t stream) {
    switch (dtype) {
        case DType::kFloat16: return launch_typed<half>(x, w, y, m, n, k, tile_m, stream);
        case DType::kBFloat16: return launch_typed<__nv_bfloat16>(x, w, y, m, n, k, tile_m, stream);
        default: return "HGEMM takes float16 or bfloat16";
    }
}

}  // namespace minfer
