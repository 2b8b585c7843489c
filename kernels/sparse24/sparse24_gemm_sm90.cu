// 2:4 prefill GEMM on sm_90a: the sparse tensor cores through wgmma.mma_async.sp, fed by TMA.
//
// y[M, N] = x[M, K] @ W[N, K]^T with W in 2:4 form. Only wgmma's A operand can be sparse, so A is the
// weight (values [N, K / 2], its kept halves) and B the tokens (x, K-major): each consumer warpgroup
// computes W-rows x tokens tiles, and the epilogue writes them transposed into y. The pipeline is the dense
// HGEMM's (hgemm_sm90.cu): one persistent CTA per SM, warpgroup 0 the producer (one thread issues the TMA
// loads of a k-block: the values box, the x boxes and, by a plain bulk copy, the k-block's metadata),
// warpgroups 1 and 2 the consumers, `full` / `empty` mbarriers per stage.
//
// Metadata: wgmma.sp takes it from registers, one 32-bit word per thread per instruction (lanes t = 0, 1
// of each quad; rows g and g + 8 of the warp's 16 in its halves, logical columns 16 t .. 16 t + 15). The
// format's `gemm_meta` (ops.sparse24_gemm_metadata) stores exactly those words in 512-byte atoms of 64
// rows x 64 logical columns, so a consumer thread reads a k-block's two k-steps with one 8-byte shared load.
// The instruction reads that register after it issues, and ptxas does not keep it from reusing the register
// while the wgmma is in flight: with one k-block in flight (wait_group 1) it loaded the next k-block's words
// into the same registers (SASS: LDS.64 R88 each k-block, HGMMA.SP ... R88, R89), and the results were wrong
// on the device from 3 k-blocks on (docs/perf-notes.md, 2026-11-28). So even and odd k-blocks keep their words
// in two register sets, and each set is stored once more to a per-thread shared slot after the wait that
// retires its wgmmas: a shared store cannot move above that wait (wgmmas read shared memory), so the registers
// stay live, and the next k-block's words go elsewhere.
#include "common/sm90a.cuh"
#include "dense/hgemm_common.cuh"
#include "sparse24.h"

namespace minfer {

namespace {

constexpr int kThreads = 384;            // producer warpgroup + 2 consumer warpgroups
constexpr int kEpiBox = 64;              // the output box: 64 tokens x 64 features (one 128-byte swizzle row)
constexpr int kEpiBytes = kEpiBox * kEpiBox * 2;
constexpr int kBand = 16;                // token tiles per band in the tile order (hgemm_common.cuh)
constexpr int kSmemLimit = 227 * 1024;
constexpr int kAtomBytes = kSparse24GemmAtomWords * 4;

constexpr int kBK = 64;  // logical K per stage: the values' box is 32 halves (64 bytes, that swizzle) wide

// BM weight rows x BN tokens per tile; as many stages as fit.
template <int BM, int BN>
struct SparseTile {
    static constexpr int kRowBlocks = BM / 128;   // m64 row blocks per consumer warpgroup
    static constexpr int kSteps = kBK / 32;       // k32 instructions per stage
    static constexpr int kStageA = BM * kBK;      // BM rows of kBK / 2 halves
    static constexpr int kStageB = BN * kBK * 2;  // one box of BN rows x 128 bytes
    static constexpr int kStageE = BM / 64 * kAtomBytes;
    static constexpr int kStageBytes = kStageA + kStageB + kStageE;
    static constexpr int kEpiTotal = 2 * 2 * kEpiBytes;  // two buffers per consumer warpgroup
    static constexpr int kSlack = 1024;                   // to align the dynamic buffer to 1024 B
    static constexpr int kBarrierBytes = 2 * 8 * 8;       // up to 8 stages x (full, empty)
    static constexpr int kKeepBytes = 256 * 16 * kRowBlocks;  // each consumer thread's two metadata slots
    static constexpr int kFit = (kSmemLimit - kEpiTotal - kSlack - kBarrierBytes - kKeepBytes) / kStageBytes;
    static constexpr int kStages = kFit < 8 ? kFit : 8;
    static constexpr int kSmemBytes = kSlack + kStages * kStageBytes + kEpiTotal + kBarrierBytes + kKeepBytes;
    static_assert(BM == 128 || BM == 256, "a consumer warpgroup owns one or two m64 row blocks");
    static_assert(BN % kEpiBox == 0 && BN <= 256 && BM / 128 * BN <= 256, "at most 128 accumulators a thread");
    static_assert(kStageBytes % 1024 == 0, "stages start on the swizzle atom");
    static_assert(kStages >= 3, "too little shared memory for a pipeline");
};

#ifdef MINFER_SM90A

// Global -> shared bulk copy of `bytes` (a multiple of 16), completing on `bar`.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// A shared store of two registers, to keep them live until this point (see the file comment).
__device__ __forceinline__ void keep_registers(uint32_t addr, uint32_t a, uint32_t b) {
    asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(addr), "r"(a), "r"(b) : "memory");
}

__device__ __forceinline__ uint2 load_shared_8B(uint32_t addr) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
    return v;
}

// D (64 x N, fp32) += A (64 x 32 logical, 2:4: 64 x 16 stored) * B (32 x N), sparsity selector 0 (metadata
// from lanes t = 0, 1). DA, DB, E, SD: operand numbers of the descriptors, the metadata and scale_d.
#define MINFER_WGMMA_SP(TYPE, SHAPE, REGS, DA, DB, E, SD, ...)                                               \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" SD ", 0;\nwgmma.mma_async.sp.sync.aligned." SHAPE        \
                 ".f32." TYPE "." TYPE " {" REGS "}, %" DA ", %" DB ", %" E ", 0, p, 1, 1, 0, 0;\n}\n"          \
                 : __VA_ARGS__                                                                               \
                 : "l"(desc_a), "l"(desc_b), "r"(meta), "r"(scale_d))
#define MINFER_WGMMA_SP_TYPED(...) MINFER_WGMMA_BY_TYPE(MINFER_WGMMA_SP, __VA_ARGS__)

template <int BN, typename T>
__device__ __forceinline__ void wgmma_sp_k32(float (&d)[BN / 2], uint64_t desc_a, uint64_t desc_b, uint32_t meta,
                                             int scale_d) {
    if constexpr (BN == 128) {
        MINFER_WGMMA_SP_TYPED("m64n128k32", MINFER_WGMMA_REGS0 ", " MINFER_WGMMA_REGS1, "64", "65", "66", "67",
                              MINFER_F32(0), MINFER_F32(32));
    } else {
        static_assert(BN == 256, "tile N is 128 or 256");
        MINFER_WGMMA_SP_TYPED(
            "m64n256k32", MINFER_WGMMA_REGS0 ", " MINFER_WGMMA_REGS1 ", " MINFER_WGMMA_REGS2 ", " MINFER_WGMMA_REGS3,
            "128", "129", "130", "131", MINFER_F32(0), MINFER_F32(32), MINFER_F32(64), MINFER_F32(96));
    }
}

#endif  // MINFER_SM90A

template <typename T, int BM, int BN>
__global__ void __launch_bounds__(kThreads, 1)
    sparse24_gemm_sm90_kernel(const __grid_constant__ CUtensorMap map_w, const __grid_constant__ CUtensorMap map_x,
                              const __grid_constant__ CUtensorMap map_y, const uint32_t* __restrict__ gemm_meta,
                              int M, int N, int K, int k_atoms) {
#ifdef MINFER_SM90A
    using Tile = SparseTile<BM, BN>;
    constexpr int S = Tile::kStages;
    constexpr int RB = Tile::kRowBlocks;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t base = (shared_address(smem_raw) + 1023) & ~1023u;
    const uint32_t epi_base = base + S * Tile::kStageBytes;
    const uint32_t full_bar = epi_base + Tile::kEpiTotal;  // S barriers of 8 bytes
    const uint32_t empty_bar = full_bar + S * 8;
    const uint32_t keep_base = full_bar + Tile::kBarrierBytes;  // the metadata slots

    const int warpgroup = threadIdx.x / 128;
    const int tiles_t = (M + BN - 1) / BN, tiles_w = (N + BM - 1) / BM;
    const int num_tiles = tiles_t * tiles_w;
    const int num_k = K / kBK;

    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            mbar_init(full_bar + 8 * s, 1);   // the producer's arrive.expect_tx
            mbar_init(empty_bar + 8 * s, 8);  // one arrival per consumer warp
        }
        fence_mbarrier_init();
    }
    __syncthreads();

    if (warpgroup == 0) {
        setmaxnreg_dec<40>();
        if (threadIdx.x == 0) {
            int it = 0;  // k-blocks issued so far: stage it % S, ring pass it / S
            for (int unit = blockIdx.x; unit < num_tiles; unit += gridDim.x) {
                const TileCoord tile = tile_coord(unit, tiles_t, tiles_w, kBand);  // m: tokens, n: weight rows
                for (int kb = 0; kb < num_k; ++kb, ++it) {
                    const int s = it % S;
                    mbar_wait(empty_bar + 8 * s, ((it / S) & 1) ^ 1);
                    const uint32_t stage = base + s * Tile::kStageBytes, bar = full_bar + 8 * s;
                    mbar_arrive_expect_tx(bar, Tile::kStageBytes);  // boxes count in full, zero fill included
                    tma_load(stage, &map_w, kb * (kBK / 2), tile.n * BM, bar);
                    tma_load(stage + Tile::kStageA, &map_x, kb * kBK, tile.m * BN, bar);
#pragma unroll
                    for (int rb = 0; rb < BM / 64; ++rb) {
                        const int64_t atom = static_cast<int64_t>(tile.n * (BM / 64) + rb) * k_atoms + kb;
                        bulk_load(stage + Tile::kStageA + Tile::kStageB + rb * kAtomBytes,
                                  gemm_meta + atom * kSparse24GemmAtomWords, kAtomBytes, bar);
                    }
                }
            }
        }
    } else {
        setmaxnreg_inc<232>();
        const int consumer = warpgroup - 1;  // rows [BM / 2 * consumer, + BM / 2) of the tile
        const int t128 = threadIdx.x % 128, lane = threadIdx.x % 32, warp = t128 / 32;
        const uint32_t epi_own = epi_base + consumer * 2 * kEpiBytes;
        // This thread's metadata words in an atom: lanes t = 2, 3 read t - 2's (the instruction ignores them).
        const uint32_t meta_offset = 4 * (32 * warp + 16 * (lane & 1) + 2 * (lane >> 2));
        // stmatrix.trans row address of this lane: matrix lane / 8 is (features +8 if odd) x (tokens +8 if >= 2).
        const int epi_token = ((lane >> 4) & 1) * 8 + (lane & 7);
        const int epi_chunk = 2 * warp + ((lane >> 3) & 1);
        auto release = [&](int s) {  // this warp is done reading stage s
            if (lane == 0) mbar_arrive(empty_bar + 8 * s);
        };
        float acc[RB][BN / 2] = {};
        uint32_t meta_even[RB][Tile::kSteps] = {}, meta_odd[RB][Tile::kSteps] = {};
        // Even and odd k-blocks' slots apart, so that no store overwrites the other set's unread.
        const uint32_t keep_even = keep_base + (threadIdx.x - 128) * 16 * RB, keep_odd = keep_even + 8 * RB;
        auto keep_metadata = [&](uint32_t (&meta)[RB][Tile::kSteps], uint32_t slot) {
#pragma unroll
            for (int j = 0; j < RB; ++j) keep_registers(slot + 8 * j, meta[j][0], meta[j][1]);
        };
        int it = 0;   // k-blocks consumed so far
        int epi = 0;  // output boxes stored so far: buffer epi % 2
        // One k-block: its metadata into `meta`, its wgmmas; then, once the previous k-block's wgmmas are done,
        // that block's metadata registers (`previous`) are kept up to here and its stage handed back.
        auto consume = [&](uint32_t (&meta)[RB][Tile::kSteps], uint32_t (&previous)[RB][Tile::kSteps],
                           uint32_t previous_slot, int kb) {
            const int s = it % S;
            mbar_wait(full_bar + 8 * s, (it / S) & 1);
            const uint32_t stage = base + s * Tile::kStageBytes;
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                const uint2 v = load_shared_8B(stage + Tile::kStageA + Tile::kStageB +
                                               (consumer * RB + j) * kAtomBytes + meta_offset);
                meta[j][0] = v.x;
                meta[j][1] = v.y;
            }
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < Tile::kSteps; ++k) {
                const uint64_t desc_b = smem_descriptor(stage + Tile::kStageA) + 4 * k;
#pragma unroll
                for (int j = 0; j < RB; ++j) {
                    const uint64_t desc_a = smem_descriptor<kBK>(stage + (consumer * RB + j) * 64 * kBK) + 2 * k;
                    wgmma_sp_k32<BN, T>(acc[j], desc_a, desc_b, meta[j][k], kb > 0 || k > 0);
                }
            }
            wgmma_commit();
            if (kb > 0) {
                wgmma_wait<1>();
                keep_metadata(previous, previous_slot);
                release((it - 1) % S);
            }
            ++it;
        };
        for (int unit = blockIdx.x; unit < num_tiles; unit += gridDim.x) {
            const TileCoord tile = tile_coord(unit, tiles_t, tiles_w, kBand);
            for (int kb = 0; kb < num_k; kb += 2) {
                consume(meta_even, meta_odd, keep_odd, kb);
                if (kb + 1 < num_k) consume(meta_odd, meta_even, keep_even, kb + 1);
            }
            wgmma_wait<0>();
#pragma unroll
            for (int j = 0; j < RB; ++j) fence_registers(acc[j]);
            keep_metadata(meta_even, keep_even);
            keep_metadata(meta_odd, keep_odd);
            release((it - 1) % S);

            // Epilogue, one 64-feature x 64-token box at a time: registers -> swizzled shared buffer with
            // stmatrix.trans (tokens become rows) -> TMA store into y. Accumulator layout: d[4 i + {0,1}] at
            // feature row lane / 4, d[4 i + {2,3}] at lane / 4 + 8 of the warp's 16, tokens 8 i + 2 (lane % 4)
            // + {0, 1}.
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                const int feature0 = tile.n * BM + (consumer * RB + j) * 64;
                if (feature0 >= N) break;  // this row block and the next are past the end (last tile column)
#pragma unroll
                for (int c = 0; c < BN / kEpiBox; ++c) {
                    const int token0 = tile.m * BN + c * kEpiBox;
                    if (token0 >= M) break;
                    const uint32_t buf = epi_own + (epi & 1) * kEpiBytes;
                    ++epi;
                    store_box(&map_y, buf, feature0, token0, 1 + consumer, t128 == 0, [&] {
#pragma unroll
                        for (int p = 0; p < 4; ++p) {
                            const int i = c * 8 + 2 * p;  // n8 blocks i and i + 1
                            const int row = 16 * p + epi_token;
                            stmatrix_x4<true>(buf + row * 128 + ((epi_chunk ^ (row & 7)) << 4),
                                              pack2<T>(acc[j][4 * i], acc[j][4 * i + 1]),
                                              pack2<T>(acc[j][4 * i + 2], acc[j][4 * i + 3]),
                                              pack2<T>(acc[j][4 * i + 4], acc[j][4 * i + 5]),
                                              pack2<T>(acc[j][4 * i + 6], acc[j][4 * i + 7]));
                        }
                    });
                }
            }
        }
        if (t128 == 0) tma_store_wait_all();
    }
#endif
}

template <typename T, int BM, int BN>
const char* launch_tile(const void* values, const int32_t* gemm_meta, const void* x, void* y, int m, int n, int k,
                        int k_atoms, DType dtype, cudaStream_t stream) {
    using Tile = SparseTile<BM, BN>;
    constexpr auto kernel = sparse24_gemm_sm90_kernel<T, BM, BN>;
    if (!opt_in_shared_memory<kernel>(Tile::kSmemBytes))
        return "this GPU cannot give the 2:4 sm90 GEMM kernel the shared memory it needs";
    CUtensorMap map_w, map_x, map_y;
    // values [n, k / 2]: boxes of BM rows x 32 halves (64 bytes, that swizzle)
    if (!make_map(&map_w, values, dtype, n, k / 2, k, BM, kBK) ||
        !make_map(&map_x, x, dtype, m, k, 2 * k, BN) || !make_map(&map_y, y, dtype, m, n, 2 * n, kEpiBox))
        return "cuTensorMapEncodeTiled failed (driver too old for TMA, or a pointer not 16-byte aligned)";
    const int tiles = ((m + BN - 1) / BN) * ((n + BM - 1) / BM);
    const int sms = multiprocessors(current_device());
    kernel<<<tiles < sms ? tiles : sms, kThreads, Tile::kSmemBytes, stream>>>(
        map_w, map_x, map_y, reinterpret_cast<const uint32_t*>(gemm_meta), m, n, k, k_atoms);
    if (cudaGetLastError() != cudaSuccess) return "launching the 2:4 sm90 GEMM kernel failed";
    return nullptr;
}

// The tile of the fastest variant in the one timed run (H200, docs/perf-notes.md, 2026-11-28): 256 x 128 at
// 8192 tokens on all five Llama-2-7B shapes; 128 x 256 at 2048 on all five and at 512 where its tiles fill
// the SMs; 128 x 128 at 512 where they do not (N = 4096). 4096 tokens as the switch to 256 x 128 is a guess.
Sparse24GemmTile choose_tile(int m, int n, int sms) {
    if (m >= 4096) return Sparse24GemmTile::k256x128;
    const long wide = static_cast<long>((n + 127) / 128) * ((m + 255) / 256);
    return wide >= sms ? Sparse24GemmTile::k128x256 : Sparse24GemmTile::k128x128;
}

template <typename T>
const char* launch_typed(const void* values, const int32_t* gemm_meta, const void* x, void* y, int m, int n, int k,
                         int k_atoms, DType dtype, Sparse24GemmTile tile, cudaStream_t stream) {
    if (tile == Sparse24GemmTile::kAuto) tile = choose_tile(m, n, multiprocessors(current_device()));
    switch (tile) {
        case Sparse24GemmTile::k128x128:
            return launch_tile<T, 128, 128>(values, gemm_meta, x, y, m, n, k, k_atoms, dtype, stream);
        case Sparse24GemmTile::k128x256:
            return launch_tile<T, 128, 256>(values, gemm_meta, x, y, m, n, k, k_atoms, dtype, stream);
        case Sparse24GemmTile::k256x128:
            return launch_tile<T, 256, 128>(values, gemm_meta, x, y, m, n, k, k_atoms, dtype, stream);
        default: return "unknown 2:4 GEMM tile";
    }
}

}  // namespace

bool sparse24_gemm_sm90_available() { return sm90a_kernel_available<sparse24_gemm_sm90_kernel<half, 128, 128>>(); }

const char* launch_sparse24_gemm(const void* values, const int32_t* gemm_meta, const void* x, void* y, int64_t m,
                                 int64_t n, int64_t k, DType dtype, Sparse24GemmTile tile, cudaStream_t stream) {
    if (!sparse24_gemm_sm90_available()) return "the 2:4 GEMM needs an sm_90 GPU and a build for 9.0a";
    if (k % kSparse24GemmKMultiple != 0 || n % 8 != 0) return "the 2:4 GEMM needs K % 64 == 0 and N % 8 == 0";
    const int k_atoms = static_cast<int>((k + 127) / 128 * 2);
    switch (dtype) {
        case DType::kFloat16:
            return launch_typed<half>(values, gemm_meta, x, y, (int)m, (int)n, (int)k, k_atoms, dtype, tile, stream);
        case DType::kBFloat16:
            return launch_typed<__nv_bfloat16>(values, gemm_meta, x, y, (int)m, (int)n, (int)k, k_atoms, dtype, tile,
                                               stream);
        default: return "the 2:4 GEMM takes float16 or bfloat16";
    }
}

}  // namespace minfer
