// HGEMM on sm_90a (H100/H200): wgmma on the tensor cores, TMA (cp.async.bulk.tensor) loads into
// 128-byte-swizzled shared memory, an mbarrier pipeline, and TMA stores for the output.
//
// One persistent CTA per SM walks output tiles of 128 x BN. Warp-specialized: warpgroup 0 is the
// producer (one thread issues the TMA loads of X and W k-blocks into a ring of stages); warpgroups
// 1 and 2 are consumers, each owning 64 rows of the tile with a 64 x BN fp32 accumulator in
// registers (wgmma m64nBNk16, both operands read from shared memory). Stage ownership passes
// through two mbarriers per stage: `full` (TMA bytes landed) and `empty` (consumers done reading).
// While consumers run the epilogue of one tile, the producer already fills stages for the next.
//
// With CLUSTER = 2, two CTAs on neighbouring SMs take vertically adjacent tiles that share one W
// tile: each loads half of it and multicasts that half into both CTAs' shared memory, so W moves
// from L2 once per pair. A stage is then free only when the consumers of both CTAs are done with
// it, so consumers also arrive on the peer CTA's `empty` barrier.
#include "common/sm90a.cuh"
#include "hgemm.h"
#include "hgemm_common.cuh"

namespace minfer {

namespace {

constexpr int kBM = 128;            // tile rows: two consumer warpgroups of 64
constexpr int kBK = 64;             // K per stage: 64 halfs = one 128-byte swizzle row
constexpr int kThreads = 384;       // producer warpgroup + 2 consumer warpgroups
constexpr int kEpiCols = 64;        // output columns per TMA store: one 128-byte swizzle row
constexpr int kEpiBytes = 64 * kEpiCols * 2;  // one consumer's 64 rows of those columns
constexpr int kBand = 16;           // tile rows per band in the tile order (hgemm_common.cuh)
constexpr int kSmemLimit = 227 * 1024;

template <int BN>
struct Sm90Tile {
    static constexpr int kStageA = kBM * kBK * 2;
    static constexpr int kStageBytes = kStageA + BN * kBK * 2;
    static constexpr int kEpiTotal = 2 * 2 * kEpiBytes;  // two buffers per consumer warpgroup
    static constexpr int kSlack = 1024;                   // to align the dynamic buffer to 1024 B
    static constexpr int kBarrierBytes = 2 * 8 * 8;       // up to 8 stages x (full, empty)
    static constexpr int kFit = (kSmemLimit - kEpiTotal - kSlack - kBarrierBytes) / kStageBytes;
    static constexpr int kStages = kFit < 8 ? kFit : 8;
    static constexpr int kSmemBytes = kSlack + kStages * kStageBytes + kEpiTotal + kBarrierBytes;
    static_assert(BN % kEpiCols == 0 && BN <= 256, "wgmma N is at most 256; epilogue works in 64 columns");
    static_assert(kStages >= 3, "too little shared memory for a pipeline");
};

#ifdef MINFER_SM90A

// The same box into this and every CTA of `cta_mask`, at the same shared-memory offsets; each
// destination's barrier at `bar`'s offset counts the bytes.
__device__ __forceinline__ void tma_load_multicast(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                                   uint32_t bar, uint16_t cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(bar), "h"(cta_mask)
        : "memory");
}

// Arrival on the barrier at the same offset in CTA `cta` of this cluster. Default (CTA-scope)
// semantics: the wgmma reads it vouches for completed at wgmma.wait_group; a cluster-scope release
// would add a MEMBAR.ALL.GPU before every arrival.
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta) {
    asm volatile(
        "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
        "r"(cta)
        : "memory");
}

__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    return rank;
}

// Every thread of every CTA in the cluster; orders shared-memory writes (barrier init) cluster-wide.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

#endif  // MINFER_SM90A

template <typename T, int BN, int CLUSTER>
__global__ void __launch_bounds__(kThreads, 1)
    hgemm_sm90_kernel(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                      const __grid_constant__ CUtensorMap map_y, int M, int N, int K, int x_box_rows) {
#ifdef MINFER_SM90A
    using Tile = Sm90Tile<BN>;
    constexpr int S = Tile::kStages;
    constexpr int kRowsW = BN / CLUSTER;  // rows of the W tile this CTA loads (and multicasts)
    extern __shared__ uint8_t smem_raw[];
    // 128-byte swizzle atoms repeat every 1024 bytes: stages and epilogue buffers start on 1024.
    const uint32_t base = (shared_address(smem_raw) + 1023) & ~1023u;
    const uint32_t epi_base = base + S * Tile::kStageBytes;
    const uint32_t full_bar = epi_base + Tile::kEpiTotal;  // S barriers of 8 bytes
    const uint32_t empty_bar = full_bar + S * 8;

    const int warpgroup = threadIdx.x / 128;
    const int rank = CLUSTER > 1 ? static_cast<int>(cluster_rank()) : 0;
    const int tiles_m = (M + kBM - 1) / kBM, tiles_n = (N + BN - 1) / BN;
    // A work unit is CLUSTER vertically adjacent tiles sharing one W tile; CTA `rank` takes one of them.
    const int units_m = (tiles_m + CLUSTER - 1) / CLUSTER;
    const int num_units = units_m * tiles_n;
    const int first_unit = blockIdx.x / CLUSTER, unit_step = gridDim.x / CLUSTER;
    const int num_k = (K + kBK - 1) / kBK;
    auto tile_of = [&](int unit) {
        const TileCoord u = tile_coord(unit, units_m, tiles_n, kBand / CLUSTER);
        return TileCoord{u.m * CLUSTER + rank, u.n};
    };

    init_ring_barriers(full_bar, empty_bar, S, 8 * CLUSTER);  // empty: one arrival per consumer warp of the cluster
    if constexpr (CLUSTER > 1) {
        cluster_sync();  // the peer's barriers exist before anything multicasts or arrives on them
    } else {
        __syncthreads();
    }

    if (warpgroup == 0) {
        setmaxnreg_dec<40>();
        if (threadIdx.x == 0) {
            int it = 0;  // k-blocks issued so far: stage it % S, ring pass it / S
            for (int unit = first_unit; unit < num_units; unit += unit_step) {
                const TileCoord tile = tile_of(unit);
                for (int kb = 0; kb < num_k; ++kb, ++it) {
                    const int s = it % S;
                    mbar_wait(empty_bar + 8 * s, ((it / S) & 1) ^ 1);
                    const uint32_t stage = base + s * Tile::kStageBytes;
                    const uint32_t w_rows = stage + Tile::kStageA + rank * kRowsW * 128;
                    // X box + the whole W tile
                    mbar_arrive_expect_tx(full_bar + 8 * s, x_box_rows * kBK * 2 + BN * kBK * 2);
                    tma_load(stage, &map_x, kb * kBK, tile.m * kBM, full_bar + 8 * s);
                    if constexpr (CLUSTER > 1) {
                        tma_load_multicast(w_rows, &map_w, kb * kBK, tile.n * BN + rank * kRowsW, full_bar + 8 * s,
                                           (1u << CLUSTER) - 1);
                    } else {
                        tma_load(w_rows, &map_w, kb * kBK, tile.n * BN, full_bar + 8 * s);
                    }
                }
            }
        }
    } else {
        setmaxnreg_inc<232>();
        const int consumer = warpgroup - 1;  // rows [64 * consumer, 64 * consumer + 64) of the tile
        const int t128 = threadIdx.x % 128, lane = threadIdx.x % 32, warp = t128 / 32;
        const uint32_t epi_own = epi_base + consumer * 2 * kEpiBytes;
        // stmatrix row address of this lane: matrix lane / 8 is (rows +8 if odd) x (n8 block +1 if >= 2).
        const int epi_row = warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
        const int epi_block = lane >> 4;
        auto release = [&](int s) {  // this warp is done reading stage s, in every CTA that filled it
            if (lane != 0) return;
            if constexpr (CLUSTER == 1) {
                mbar_arrive(empty_bar + 8 * s);
            } else {
#pragma unroll
                for (int cta = 0; cta < CLUSTER; ++cta) mbar_arrive_cluster(empty_bar + 8 * s, cta);
            }
        };
        float acc[BN / 2] = {};
        int it = 0;   // k-blocks consumed so far
        int epi = 0;  // epilogue chunks stored so far: buffer epi % 2
        for (int unit = first_unit; unit < num_units; unit += unit_step) {
            const TileCoord tile = tile_of(unit);
            consume_k_blocks<BN, T, S, Tile::kStageBytes, kBK>(acc, it, num_k, base, full_bar, consumer * 64 * 128,
                                                              Tile::kStageA, release);

            // Epilogue, 64 columns at a time: registers -> swizzled shared buffer (stmatrix) -> TMA store.
            // Accumulator layout: d[4 j + {0,1}] at row lane / 4, d[4 j + {2,3}] at row lane / 4 + 8,
            // columns 8 j + 2 (lane % 4) + {0, 1}, within this warp's 16 rows.
            const int row0 = tile.m * kBM + consumer * 64;
            if (row0 >= M) continue;  // all 64 rows past the end (only in the last tile row)
#pragma unroll
            for (int c = 0; c < BN / kEpiCols; ++c, ++epi) {
                const uint32_t buf = epi_own + (epi & 1) * kEpiBytes;
                store_box(&map_y, buf, tile.n * BN + c * kEpiCols, row0, 1 + consumer, t128 == 0, [&] {
#pragma unroll
                    for (int p = 0; p < 4; ++p) {
                        const int j = c * 8 + 2 * p;  // n8 blocks j and j + 1
                        const int chunk = 2 * p + epi_block;
                        stmatrix_x4(buf + epi_row * 128 + ((chunk ^ (epi_row & 7)) << 4),
                                    pack2<T>(acc[4 * j], acc[4 * j + 1]), pack2<T>(acc[4 * j + 2], acc[4 * j + 3]),
                                    pack2<T>(acc[4 * j + 4], acc[4 * j + 5]),
                                    pack2<T>(acc[4 * j + 6], acc[4 * j + 7]));
                    }
                });
            }
        }
        if (t128 == 0) tma_store_wait_all();
    }
    if constexpr (CLUSTER > 1) {
        __syncwarp();
        cluster_sync();  // no CTA leaves while its peer may still signal its barriers
    }
#endif
}

cudaLaunchAttribute cluster_dimension(int cluster) {
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = cluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    return attr;
}

// How many clusters of this kernel run at once (GPCs need not split evenly into pairs), asked once
// per device so that no query runs while a CUDA graph is being captured.
template <auto Kernel, int CLUSTER, int SMEM>
int resident_clusters(int device) {
    static std::atomic<int> cached[64] = {};
    int clusters = cached[device].load(std::memory_order_relaxed);
    if (clusters == 0) {
        cudaLaunchConfig_t config = {};
        cudaLaunchAttribute attr = cluster_dimension(CLUSTER);
        config.gridDim = dim3(multiprocessors(device) / CLUSTER * CLUSTER);
        config.blockDim = dim3(kThreads);
        config.dynamicSmemBytes = SMEM;
        config.attrs = &attr;
        config.numAttrs = 1;
        if (cudaOccupancyMaxActiveClusters(&clusters, Kernel, &config) != cudaSuccess || clusters <= 0) {
            cudaGetLastError();  // clear it: fall back to the SM count
            clusters = multiprocessors(device) / CLUSTER;
        }
        cached[device].store(clusters, std::memory_order_relaxed);
    }
    return clusters;
}

template <typename T, int BN, int CLUSTER>
const char* launch_tile(const void* x, const void* w, void* y, int m, int n, int k, DType dtype,
                        cudaStream_t stream) {
    using Tile = Sm90Tile<BN>;
    constexpr auto kernel = hgemm_sm90_kernel<T, BN, CLUSTER>;
    if (!opt_in_shared_memory<kernel>(Tile::kSmemBytes))
        return "this GPU cannot give the sm90 HGEMM kernel the shared memory it needs";
    // Below one tile of rows, X boxes stop at M rounded up to 8: TMA's zero fill of the rest made
    // M = 16 take 1.7x as long as M = 128 (H100). The stage rows past the box keep stale values;
    // they only feed accumulator rows >= M, which are never stored.
    const int x_box_rows = m < kBM ? (m + 7) / 8 * 8 : kBM;
    CUtensorMap map_x, map_w, map_y;
    if (!make_map(&map_x, x, dtype, m, k, 2 * k, x_box_rows) ||
        !make_map(&map_w, w, dtype, n, k, 2 * k, BN / CLUSTER) || !make_map(&map_y, y, dtype, m, n, 2 * n, 64))
        return "cuTensorMapEncodeTiled failed (driver too old for TMA, or a pointer not 16-byte aligned)";
    const int device = current_device();
    const int units = ((m + kBM * CLUSTER - 1) / (kBM * CLUSTER)) * ((n + BN - 1) / BN);
    const int resident = CLUSTER > 1 ? resident_clusters<kernel, CLUSTER, Tile::kSmemBytes>(device)
                                     : multiprocessors(device);
    cudaLaunchConfig_t config = {};
    cudaLaunchAttribute attr = cluster_dimension(CLUSTER);
    config.gridDim = dim3(CLUSTER * (units < resident ? units : resident));  // persistent: one CTA per SM
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = Tile::kSmemBytes;
    config.stream = stream;
    config.attrs = &attr;
    config.numAttrs = CLUSTER > 1 ? 1 : 0;
    if (cudaLaunchKernelEx(&config, kernel, map_x, map_w, map_y, m, n, k, x_box_rows) != cudaSuccess)
        return "launching the sm90 HGEMM kernel failed";
    return nullptr;
}

struct TileChoice {
    int tile_n;
    double efficiency;  // tensor-core throughput of this tile relative to 128 x 256, H100, M >= 8192
};

// Cluster pairs are left to explicit names until they are measured with the arrive fix above.
constexpr TileChoice kTileChoices[] = {{256, 1.0}, {192, 0.9}, {128, 0.72}, {64, 0.47}};

// The tile with the least estimated time: whole waves of tiles over the SMs, times one tile's work
// over how well that tile size keeps the tensor cores busy (wider tiles reuse each X load more).
int choose_tile_n(int m, int n, int sms) {
    int best = kTileChoices[0].tile_n;
    double best_cost = 0.0;
    for (const TileChoice& c : kTileChoices) {
        const long tiles = static_cast<long>((m + kBM - 1) / kBM) * ((n + c.tile_n - 1) / c.tile_n);
        const double cost = ((tiles + sms - 1) / sms) * c.tile_n / c.efficiency;
        if (best_cost == 0.0 || cost < best_cost) {
            best = c.tile_n;
            best_cost = cost;
        }
    }
    return best;
}

template <typename T>
const char* launch_typed(const void* x, const void* w, void* y, int m, int n, int k, DType dtype, int tile_n,
                         int cluster, cudaStream_t stream) {
    if (tile_n == 0) {
        tile_n = choose_tile_n(m, n, multiprocessors(current_device()));
        cluster = 1;
    }
    switch (cluster * 1000 + tile_n) {
        case 1064: return launch_tile<T, 64, 1>(x, w, y, m, n, k, dtype, stream);
        case 1128: return launch_tile<T, 128, 1>(x, w, y, m, n, k, dtype, stream);
        case 1192: return launch_tile<T, 192, 1>(x, w, y, m, n, k, dtype, stream);
        case 1256: return launch_tile<T, 256, 1>(x, w, y, m, n, k, dtype, stream);
        case 2128: return launch_tile<T, 128, 2>(x, w, y, m, n, k, dtype, stream);
        case 2192: return launch_tile<T, 192, 2>(x, w, y, m, n, k, dtype, stream);
        case 2256: return launch_tile<T, 256, 2>(x, w, y, m, n, k, dtype, stream);
        default: return "unknown sm90 HGEMM tile";
    }
}

}  // namespace

bool hgemm_sm90_available() { return sm90a_kernel_available<hgemm_sm90_kernel<half, 256, 1>>(); }

const char* launch_hgemm_sm90(const void* x, const void* w, void* y, int m, int n, int k, DType dtype, int tile_n,
                              int cluster, cudaStream_t stream) {
    if (!hgemm_sm90_available()) return "the sm90 HGEMM path needs an sm_90 GPU and a build for 9.0a";
    switch (dtype) {
        case DType::kFloat16: return launch_typed<half>(x, w, y, m, n, k, dtype, tile_n, cluster, stream);
        case DType::kBFloat16:
            return launch_typed<__nv_bfloat16>(x, w, y, m, n, k, dtype, tile_n, cluster, stream);
        default: return "HGEMM takes float16 or bfloat16";
    }
}

}  // namespace minfer
