// The KS factor kernel on sm_90a wgmma (ksmm.h, launch_ksmm_wgmma): a factor as G independent GEMMs
// y_g [tokens, b] = x_g [tokens, c] W_g [b, c]^T, x_g the columns g*c .. g*c + c - 1 of x and W_g a contiguous
// [b, c] block. A d = 1 factor is that with G = a on its natural x and W; a d > 1 factor is that with
// G = a*d, g = i*d + l, on x in its batch-major order and W in the per-l layout [a][d][b][c] (ksmm.h).
//
// The pipeline is the dense HGEMM's (hgemm_sm90.cu): one persistent CTA per SM walks tiles of 128 tokens x BN
// outputs r of one group, warpgroup 0 the producer (one thread issues a k-block's TMA boxes: x at column g*c
// through a 3-D map [tokens][G][c], so a k-block never reads past its group, and W_g's BN rows through a 3-D
// map [G][b][c]; both zero-filled past c and b), warpgroups 1 and 2 the consumers (64 tokens each, wgmma
// m64nBNk16 from the 128-byte-swizzled stages, fp32 accumulators), `full` / `empty` mbarriers per stage.
// The epilogue writes each (token, g, r) to the output order's address: the factor's natural position
// (i*b + r)*d + l, or that position's place in the next factor's batch-major order. 64 outputs r at a time go
// through a padded shared buffer per consumer; at d = 1 into the natural order each thread then stores 16-byte
// runs of a token's outputs, else a thread keeps one r (one address computation) over 32 tokens while the
// warp's lanes take r's whose addresses are neighbours (into a batch-major order: r's of one l' of the next
// factor, i.e. consecutive k). Stores straight from the accumulator registers ran 1.2-2.7x slower on the H200
// (docs/perf-notes.md, 2026-11-28).
#include "common/sm90a.cuh"
#include "dense/hgemm_common.cuh"
#include "ksmm/ksmm.h"

namespace minfer {

namespace {

constexpr int kBM = 128;       // tile tokens: two consumer warpgroups of 64
constexpr int kBK = 64;        // k per stage: one 128-byte swizzle row
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kBand = 16;      // tile rows per band in the tile order (hgemm_common.cuh)
constexpr int kSmemLimit = 227 * 1024;

constexpr int kEpiCols = 64;                 // outputs r per staged epilogue chunk
constexpr int kEpiPitch = kEpiCols * 2 + 16;  // bytes per token row: a quarter warp's rows hit distinct banks
constexpr int kEpiBytes = 64 * kEpiPitch;     // one consumer's 64 tokens

template <int BN>
struct GroupTile {
    static constexpr int kStageA = kBM * kBK * 2;
    static constexpr int kStageBytes = kStageA + BN * kBK * 2;
    static constexpr int kSlack = 1024;              // to align the dynamic buffer to 1024 B
    static constexpr int kBarrierBytes = 2 * 8 * 8;  // up to 8 stages x (full, empty)
    static constexpr int kEpiTotal = 2 * kEpiBytes;  // one buffer per consumer warpgroup
    static constexpr int kFit = (kSmemLimit - kSlack - kBarrierBytes - kEpiTotal) / kStageBytes;
    static constexpr int kStages = kFit < 8 ? kFit : 8;
    static constexpr int kSmemBytes = kSlack + kStages * kStageBytes + kEpiTotal + kBarrierBytes;
    static_assert(kStages >= 3, "too little shared memory for a pipeline");
    static_assert(BN % kEpiCols == 0, "the staged epilogue works in chunks of 64 outputs");
};

// Where output (g, r) of a token goes (ksmm.h, launch_ksmm_wgmma): the natural position p = (i*b + r)*d + l
// for g = i*d + l, and with next_d > 1 p's place in the next factor's batch-major order.
struct OutputOrder {
    int b, d, next_c, next_d;

    __device__ __forceinline__ int column(int g, int r) const {
        const int p = ((g / d) * b + r) * d + g % d;
        if (next_d == 1) return p;
        const int run = next_c * next_d;  // one i' of the next factor
        const int q = p % run;
        return ((p / run) * next_d + q % next_d) * next_c + q / next_d;
    }
};

template <typename T, int BN>
__global__ void __launch_bounds__(kThreads, 1)
    ksmm_wgmma_kernel(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                      T* __restrict__ y, int tokens, int groups, int c, int x_box_rows, OutputOrder order) {
#ifdef MINFER_SM90A
    using Tile = GroupTile<BN>;
    constexpr int S = Tile::kStages;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t base = (shared_address(smem_raw) + 1023) & ~1023u;  // swizzle atoms repeat every 1024 B
    const uint32_t epi_base = base + S * Tile::kStageBytes;
    const uint32_t full_bar = epi_base + Tile::kEpiTotal;
    const uint32_t empty_bar = full_bar + S * 8;

    const int warpgroup = threadIdx.x / 128;
    const int b = order.b;
    const int tiles_m = (tokens + kBM - 1) / kBM, tiles_r = (b + BN - 1) / BN;
    const int tiles_n = groups * tiles_r;
    const int num_tiles = tiles_m * tiles_n;
    const int num_k = (c + kBK - 1) / kBK;

    init_ring_barriers(full_bar, empty_bar, S, 8);  // empty: one arrival per consumer warp
    __syncthreads();

    if (warpgroup == 0) {
        setmaxnreg_dec<40>();
        if (threadIdx.x == 0) {
            int it = 0;  // k-blocks issued so far: stage it % S, ring pass it / S
            for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
                const TileCoord t = tile_coord(tile, tiles_m, tiles_n, kBand);
                const int g = t.n / tiles_r, r0 = (t.n % tiles_r) * BN;
                for (int kb = 0; kb < num_k; ++kb, ++it) {
                    const int s = it % S;
                    mbar_wait(empty_bar + 8 * s, ((it / S) & 1) ^ 1);
                    const uint32_t stage = base + s * Tile::kStageBytes;
                    mbar_arrive_expect_tx(full_bar + 8 * s, x_box_rows * kBK * 2 + BN * kBK * 2);
                    tma_load_3d(stage, &map_x, kb * kBK, g, t.m * kBM, full_bar + 8 * s);
                    tma_load_3d(stage + Tile::kStageA, &map_w, kb * kBK, r0, g, full_bar + 8 * s);
                }
            }
        }
    } else {
        setmaxnreg_inc<232>();
        const int consumer = warpgroup - 1;  // tokens [64 * consumer, 64 * consumer + 64) of the tile
        const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
        auto release = [&](int s) {  // this warp is done reading stage s
            if (lane == 0) mbar_arrive(empty_bar + 8 * s);
        };
        const bool pairs = order.d == 1 && order.next_d == 1;  // r, r + 1 adjacent in y (b even)
        // Into the next factor's batch-major order from d = 1, a chunk's r's of one residue mod next_d are
        // consecutive k's there: the lanes take them in that order (next_d divides the chunk).
        const bool grouped = order.d == 1 && order.next_d > 1 && kEpiCols % order.next_d == 0;
        const int per_slot = grouped ? kEpiCols / order.next_d : 1;
        const int64_t ldy = static_cast<int64_t>(groups) * b;
        float acc[BN / 2] = {};
        int it = 0;  // k-blocks consumed so far
        for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
            const TileCoord t = tile_coord(tile, tiles_m, tiles_n, kBand);
            const int g = t.n / tiles_r, r0 = (t.n % tiles_r) * BN;
            consume_k_blocks<BN, T, S, Tile::kStageBytes, kBK>(acc, it, num_k, base, full_bar, consumer * 64 * 128,
                                                              Tile::kStageA, release);

            // acc[4 j + {0, 1}]: token lane / 4 of this warp's 16, outputs r0 + 8 j + 2 (lane % 4) + {0, 1};
            // acc[4 j + {2, 3}]: token lane / 4 + 8, the same outputs.
            const int token_base = t.m * kBM + consumer * 64;
            uint8_t* buf = smem_raw + (epi_base - shared_address(smem_raw)) + consumer * kEpiBytes;
            const int row = warp * 16 + lane / 4;
#pragma unroll
            for (int chunk = 0; chunk < BN / kEpiCols; ++chunk) {
                const int r_chunk = r0 + chunk * kEpiCols;
                if (r_chunk >= b) continue;  // the same for the whole warpgroup
                named_barrier_sync(1 + consumer, 128);  // the last chunk's reads of the buffer are done
#pragma unroll
                for (int jj = 0; jj < kEpiCols / 8; ++jj) {
                    const int j = chunk * (kEpiCols / 8) + jj, col = 8 * jj + 2 * (lane % 4);
                    *reinterpret_cast<uint32_t*>(buf + row * kEpiPitch + col * 2) =
                        pack2<T>(acc[4 * j], acc[4 * j + 1]);
                    *reinterpret_cast<uint32_t*>(buf + (row + 8) * kEpiPitch + col * 2) =
                        pack2<T>(acc[4 * j + 2], acc[4 * j + 3]);
                }
                named_barrier_sync(1 + consumer, 128);
                const int t128 = threadIdx.x % 128;
                if (pairs) {  // 8 outputs (16 bytes) of one token a store; b % 8 == 0 keeps them whole
#pragma unroll
                    for (int pass = 0; pass < 64 * kEpiCols / 8 / 128; ++pass) {
                        const int e = pass * 128 + t128, token_row = e / (kEpiCols / 8), q = e % (kEpiCols / 8);
                        const int r = r_chunk + 8 * q, token = token_base + token_row;
                        if (r < b && token < tokens)
                            *reinterpret_cast<uint4*>(y + token * ldy + g * b + r) =
                                *reinterpret_cast<const uint4*>(buf + token_row * kEpiPitch + q * 16);
                    }
                } else {  // one r a thread, tokens t128 / 64, + 2, ...; lanes on r's of neighbouring addresses
                    const int lane64 = t128 % kEpiCols;
                    const int r_local = grouped ? lane64 % per_slot * order.next_d + lane64 / per_slot : lane64;
                    const int r = r_chunk + r_local;
                    if (r < b) {
                        T* out = y + order.column(g, r);
                        for (int token_row = t128 / kEpiCols; token_row < 64; token_row += 128 / kEpiCols) {
                            const int token = token_base + token_row;
                            if (token >= tokens) break;
                            const uint8_t* staged = buf + token_row * kEpiPitch + r_local * 2;
                            out[token * ldy] = *reinterpret_cast<const T*>(staged);
                        }
                    }
                }
            }
        }
    }
#endif
}

struct TileChoice {
    int tile_n;
    double efficiency;  // tensor-core throughput of 128 x tile_n relative to 128 x 256 (hgemm_sm90.cu's table)
};

constexpr TileChoice kTileChoices[] = {{256, 1.0}, {192, 0.9}, {128, 0.72}, {64, 0.47}};

// The tile with the least estimated time: whole waves of tiles over the SMs (a group's last tile of r's counts
// whole), times one tile's work over how well its size keeps the tensor cores busy.
int choose_tile_n(int tokens, int groups, int b, int sms) {
    int best = kTileChoices[0].tile_n;
    double best_cost = 0.0;
    for (const TileChoice& choice : kTileChoices) {
        const long tiles =
            static_cast<long>((tokens + kBM - 1) / kBM) * groups * ((b + choice.tile_n - 1) / choice.tile_n);
        const double cost = ((tiles + sms - 1) / sms) * choice.tile_n / choice.efficiency;
        if (best_cost == 0.0 || cost < best_cost) {
            best = choice.tile_n;
            best_cost = cost;
        }
    }
    return best;
}

template <typename T, int BN>
const char* launch_tile(const void* x, const void* w, void* y, int tokens, int groups, int b, int c,
                        const OutputOrder& order, DType dtype, cudaStream_t stream) {
    using Tile = GroupTile<BN>;
    constexpr auto kernel = ksmm_wgmma_kernel<T, BN>;
    if (!opt_in_shared_memory<kernel>(Tile::kSmemBytes))
        return "this GPU cannot give the KS wgmma kernel the shared memory it needs";
    // Below one tile of tokens the x boxes stop at the batch rounded up to 8 (as the dense HGEMM's do); the
    // stage rows past the box only feed accumulator rows that are never stored.
    const int x_box_rows = tokens < kBM ? (tokens + 7) / 8 * 8 : kBM;
    const cuuint64_t x_dims[3] = {static_cast<cuuint64_t>(c), static_cast<cuuint64_t>(groups),
                                  static_cast<cuuint64_t>(tokens)};
    const cuuint64_t x_strides[2] = {static_cast<cuuint64_t>(c) * 2, static_cast<cuuint64_t>(groups) * c * 2};
    const cuuint32_t x_box[3] = {kBK, 1, static_cast<cuuint32_t>(x_box_rows)};
    const cuuint64_t w_dims[3] = {static_cast<cuuint64_t>(c), static_cast<cuuint64_t>(b),
                                  static_cast<cuuint64_t>(groups)};
    const cuuint64_t w_strides[2] = {static_cast<cuuint64_t>(c) * 2, static_cast<cuuint64_t>(b) * c * 2};
    const cuuint32_t w_box[3] = {kBK, BN, 1};
    CUtensorMap map_x, map_w;
    if (!encode_swizzled_map(&map_x, x, dtype, 3, x_dims, x_strides, x_box) ||
        !encode_swizzled_map(&map_w, w, dtype, 3, w_dims, w_strides, w_box))
        return "cuTensorMapEncodeTiled failed (driver too old for TMA, or a pointer not 16-byte aligned)";
    const long tiles = static_cast<long>((tokens + kBM - 1) / kBM) * groups * ((b + BN - 1) / BN);
    const int sms = multiprocessors(current_device());
    kernel<<<static_cast<unsigned>(tiles < sms ? tiles : sms), kThreads, Tile::kSmemBytes, stream>>>(
        map_x, map_w, static_cast<T*>(y), tokens, groups, c, x_box_rows, order);
    if (cudaGetLastError() != cudaSuccess) return "launching the KS wgmma kernel failed";
    return nullptr;
}

template <typename T>
const char* launch_typed(const void* x, const void* w, void* y, int tokens, int groups, int b, int c,
                         const OutputOrder& order, int tile_n, DType dtype, cudaStream_t stream) {
    if (tile_n == 0) tile_n = choose_tile_n(tokens, groups, b, multiprocessors(current_device()));
    switch (tile_n) {
        case 64: return launch_tile<T, 64>(x, w, y, tokens, groups, b, c, order, dtype, stream);
        case 128: return launch_tile<T, 128>(x, w, y, tokens, groups, b, c, order, dtype, stream);
        case 192: return launch_tile<T, 192>(x, w, y, tokens, groups, b, c, order, dtype, stream);
        case 256: return launch_tile<T, 256>(x, w, y, tokens, groups, b, c, order, dtype, stream);
        default: return "the KS wgmma tile is 64, 128, 192 or 256 outputs wide (0: by shape)";
    }
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

bool ksmm_wgmma_available() { return sm90a_kernel_available<ksmm_wgmma_kernel<half, 256>>(); }

bool ksmm_wgmma_supports(int64_t tokens, int64_t groups, int64_t b, int64_t c, const void* x, const void* w,
                         const void* y) {
    return tokens >= 1 && groups >= 1 && b >= 1 && c >= 1 && b % kKsmmWgmmaMultiple == 0 &&
           c % kKsmmWgmmaMultiple == 0 && tokens * groups * c <= INT32_MAX && tokens * groups * b <= INT32_MAX &&
           groups * b * c <= INT32_MAX && aligned(x, 16) && aligned(w, 16) && aligned(y, 16) &&
           ksmm_wgmma_available();
}

const char* launch_ksmm_wgmma(const void* x, const void* w, void* y, int64_t tokens, int64_t groups, int64_t b,
                              int64_t c, int64_t d, int64_t next_c, int64_t next_d, int tile_n, DType dtype,
                              cudaStream_t stream) {
    if (!ksmm_wgmma_supports(tokens, groups, b, c, x, w, y))
        return "the KS wgmma kernel cannot run this factor (ksmm_wgmma_supports)";
    const OutputOrder order{static_cast<int>(b), static_cast<int>(d), static_cast<int>(next_c),
                            static_cast<int>(next_d)};
    switch (dtype) {
        case DType::kFloat16:
            return launch_typed<half>(x, w, y, tokens, groups, b, c, order, tile_n, dtype, stream);
        case DType::kBFloat16:
            return launch_typed<__nv_bfloat16>(x, w, y, tokens, groups, b, c, order, tile_n, dtype, stream);
        default: return "the KS wgmma kernel takes float16 or bfloat16";
    }
}

}  // namespace minfer
