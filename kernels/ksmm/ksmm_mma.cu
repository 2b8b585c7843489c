// The KS factor kernel "tensor-core" (ksmm_kernels.cuh): GEMM tiles per (i, group of DL = min(d, 8) l's) on
// mma.sync for batches past the bandwidth paths, fed by a cp.async ring of kStages stages with no register
// staging. A stage holds, per row of the tile (a token of x, an output j of W), the contiguous run of kBk k's
// times DL l's in 16-byte chunks: chunk q holds k's q * 8 / DL .. of all DL l's (d > 8: k = q, l's l0 .. l0 + 7,
// one chunk per k at stride d). DL = 1 feeds the mma with ldmatrix (row pitch 80 B: ldmatrix's 8 rows hit
// distinct banks). DL >= 2: lane (g, t) reads, for a 16-k step, chunks t + 4e (e < DL / 2) of rows g and g + 8
// with 16-byte shared loads, i.e. 4 k's of every l, and takes those 4 k's as its k-slots 2t, 2t + 1, 2t + 8,
// 2t + 9 of the mma; A and B map slots to k's by t alone, so every dot product is whole, and one PRMT per
// operand register picks an l's halves. Odd rows XOR the chunk index with 4 so that a quarter warp's two rows
// use both halves of the banks. The epilogue stores an output's DL l's (contiguous in y) at once.
#include "ksmm/ksmm.h"
#include "ksmm/ksmm_kernels.cuh"

namespace minfer::ksmm_detail {

namespace {

constexpr int kStages = 3;  // 3 and 4 measured equal on monarch-50 prefill (docs/perf-notes.md, 2026-11-28)

// A tile of BM = 32 MF tokens by BN = 32 NF outputs j for DL l's of one i; 8 warps as 2 x 4, each
// (16 MF) x (8 NF) per l. A stage: BM rows of x then BN rows of W, kRowBytes each.
template <int DL, int MF, int NF>
struct MmaTile {
    static constexpr int kBm = 32 * MF, kBn = 32 * NF, kRows = kBm + kBn;
    static constexpr int kBk = DL == 8 ? 16 : 32;  // k per stage
    static constexpr int kKPerChunk = 8 / DL;
    static constexpr int kChunksPerRow = kBk / kKPerChunk;
    static constexpr int kRowBytes = DL == 1 ? kChunksPerRow * 16 + 16 : kChunksPerRow * 16;
    static constexpr int kStageBytes = kRows * kRowBytes;
    static constexpr size_t kSmemBytes = (size_t)kStages * kStageBytes;
    static constexpr int kChunksPerThread = kRows * kChunksPerRow / kThreads;
    static_assert(kRows * kChunksPerRow % kThreads == 0, "whole chunks per thread");
    static_assert(DL == 1 || kChunksPerRow % 8 == 0, "the swizzle stays inside a row's 128-byte groups");
};

// Byte offset of chunk q of tile row `row` inside a stage.
template <int DL, int ROW_BYTES>
__device__ __forceinline__ int chunk_offset(int row, int q) {
    return row * ROW_BYTES + (DL == 1 ? q : q ^ ((row & 1) << 2)) * 16;
}

// 16 bytes of shared memory at a shared-window address.
__device__ __forceinline__ void load_shared_16B(uint32_t (&words)[4], uint32_t addr) {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(words[0]), "=r"(words[1]), "=r"(words[2]), "=r"(words[3])
                 : "r"(addr)
                 : "memory");
}

// The operand register of plane l holding k-slot values m0 and m0 + 1 of a lane's chunks (`words`: its
// DL / 2 chunks in order): value m is 16-bit element (m % (8 / DL)) * DL + l of chunk m / (8 / DL).
template <int DL>
__device__ __forceinline__ uint32_t plane_pair(const uint32_t (&words)[2 * DL], int l, int m0) {
    constexpr int per_chunk = 8 / DL;
    const int w0 = m0 / per_chunk * 4 + (m0 % per_chunk * DL + l) / 2;
    const int w1 = (m0 + 1) / per_chunk * 4 + ((m0 + 1) % per_chunk * DL + l) / 2;
    return __byte_perm(words[w0], words[w1], l % 2 ? 0x7632u : 0x5410u);
}

template <typename T, int DL, int MF, int NF>
__global__ void __launch_bounds__(kThreads) ksmm_mma_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                           T* __restrict__ y, int tokens, int a, int b, int c,
                                                           int d) {
    using Tile = MmaTile<DL, MF, NF>;
    constexpr int kBm = Tile::kBm, kBn = Tile::kBn, kBk = Tile::kBk, kRowBytes = Tile::kRowBytes;
    extern __shared__ uint4 smem_raw[];
    const uint32_t smem = smem_addr(smem_raw);

    const int l_groups = d / DL;
    const int i = blockIdx.y / l_groups, l0 = blockIdx.y % l_groups * DL;
    const int j_tiles = (b + kBn - 1) / kBn;
    const int n0 = blockIdx.x / j_tiles * kBm, j0 = blockIdx.x % j_tiles * kBn;
    const int64_t row_len = (int64_t)c * d;

    // This thread's chunks of a stage: fixed rows and chunk columns over the k loop.
    const T* src[Tile::kChunksPerThread];
    int dst[Tile::kChunksPerThread], k_of[Tile::kChunksPerThread];
#pragma unroll
    for (int p = 0; p < Tile::kChunksPerThread; ++p) {
        const int u = threadIdx.x + p * kThreads, row = u / Tile::kChunksPerRow, q = u % Tile::kChunksPerRow;
        const bool is_x = row < kBm;
        const int n = n0 + row, j = j0 + row - kBm;
        const bool ok = is_x ? n < tokens : j < b;
        src[p] = ok ? (is_x ? x + ((int64_t)n * a + i) * row_len : w + ((int64_t)i * b + j) * row_len) + l0 : nullptr;
        dst[p] = chunk_offset<DL, kRowBytes>(row, q);
        k_of[p] = q * Tile::kKPerChunk;
    }
    const auto load_stage = [&](int stage, int k0) {
#pragma unroll
        for (int p = 0; p < Tile::kChunksPerThread; ++p) {
            const int k = k0 + k_of[p];
            const bool ok = src[p] && k < c;
            cp_async_16(smem + stage * Tile::kStageBytes + dst[p], ok ? src[p] + (int64_t)k * d : x, ok);
        }
    };

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int warp_m = warp / 4 * 16 * MF, warp_n = warp % 4 * 8 * NF;
    float acc[DL][MF][NF][4] = {};
    const auto compute = [&](int stage) {
        const int base = stage * Tile::kStageBytes;
#pragma unroll
        for (int ks = 0; ks < kBk; ks += 16) {
            if constexpr (DL == 1) {
                uint32_t af[MF][4], bf[NF][2];
#pragma unroll
                for (int mf = 0; mf < MF; ++mf)
                    ldmatrix_x4(af[mf], smem + base + (warp_m + mf * 16 + lane % 16) * kRowBytes +
                                            (ks + lane / 16 * 8) * 2);
#pragma unroll
                for (int nf = 0; nf < NF; nf += 2) {
                    // matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
                    const int n_row = kBm + warp_n + nf * 8 + lane % 8 + (nf + 1 < NF ? lane / 16 * 8 : 0);
                    uint32_t r[4];
                    ldmatrix_x4(r, smem + base + n_row * kRowBytes + (ks + lane / 8 % 2 * 8) * 2);
                    bf[nf][0] = r[0];
                    bf[nf][1] = r[1];
                    if (nf + 1 < NF) {
                        bf[nf + 1][0] = r[2];
                        bf[nf + 1][1] = r[3];
                    }
                }
#pragma unroll
                for (int mf = 0; mf < MF; ++mf)
#pragma unroll
                    for (int nf = 0; nf < NF; ++nf) mma_m16n8k16<T>(acc[0][mf][nf], af[mf], bf[nf][0], bf[nf][1]);
            } else {
                const int q0 = ks / Tile::kKPerChunk + t;  // this lane's first chunk of the step
                uint32_t ra[MF][2][2 * DL], rb[NF][2 * DL];
#pragma unroll
                for (int e = 0; e < DL / 2; ++e) {
#pragma unroll
                    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            uint32_t v[4];
                            load_shared_16B(v, smem + base + chunk_offset<DL, kRowBytes>(
                                                                 warp_m + mf * 16 + g + 8 * h, q0 + 4 * e));
#pragma unroll
                            for (int k = 0; k < 4; ++k) ra[mf][h][4 * e + k] = v[k];
                        }
#pragma unroll
                    for (int nf = 0; nf < NF; ++nf) {
                        uint32_t v[4];
                        load_shared_16B(v, smem + base + chunk_offset<DL, kRowBytes>(kBm + warp_n + nf * 8 + g,
                                                                                          q0 + 4 * e));
#pragma unroll
                        for (int k = 0; k < 4; ++k) rb[nf][4 * e + k] = v[k];
                    }
                }
#pragma unroll
                for (int l = 0; l < DL; ++l) {
                    uint32_t af[MF][4];
#pragma unroll
                    for (int mf = 0; mf < MF; ++mf) {
                        af[mf][0] = plane_pair<DL>(ra[mf][0], l, 0);
                        af[mf][1] = plane_pair<DL>(ra[mf][1], l, 0);
                        af[mf][2] = plane_pair<DL>(ra[mf][0], l, 2);
                        af[mf][3] = plane_pair<DL>(ra[mf][1], l, 2);
                    }
#pragma unroll
                    for (int nf = 0; nf < NF; ++nf) {
                        const uint32_t b0 = plane_pair<DL>(rb[nf], l, 0), b1 = plane_pair<DL>(rb[nf], l, 2);
#pragma unroll
                        for (int mf = 0; mf < MF; ++mf) mma_m16n8k16<T>(acc[l][mf][nf], af[mf], b0, b1);
                    }
                }
            }
        }
    };

    const int k_tiles = (c + kBk - 1) / kBk;
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < k_tiles) load_stage(s, s * kBk);
        cp_async_commit();
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // stage kt is in for every thread, and every warp is done with stage kt - 1
        const int next = kt + kStages - 1;
        if (next < k_tiles) load_stage(next % kStages, next * kBk);
        cp_async_commit();
        compute(kt % kStages);
    }

    // c0, c1: token g, outputs j, j + 1 with j = 2t; c2, c3: token g + 8. An output's DL l's are contiguous in
    // y: one store of DL values (d = 1: j and j + 1 together where b is even).
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int nf = 0; nf < NF; ++nf)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int n = n0 + warp_m + mf * 16 + g + 8 * h, j = j0 + warp_n + nf * 8 + 2 * t;
                if (n >= tokens || j >= b) continue;
                T* out = y + (((int64_t)n * a + i) * b + j) * d + l0;
                if constexpr (DL == 1) {
                    if (b % 2 == 0) {
                        *reinterpret_cast<uint32_t*>(out) = pack2<T>(acc[0][mf][nf][2 * h], acc[0][mf][nf][2 * h + 1]);
                    } else {
                        out[0] = from_float<T>(acc[0][mf][nf][2 * h]);
                        if (j + 1 < b) out[1] = from_float<T>(acc[0][mf][nf][2 * h + 1]);
                    }
                } else {
#pragma unroll
                    for (int jj = 0; jj < 2; ++jj) {
                        if (j + jj >= b) break;
                        uint32_t words[DL / 2];
#pragma unroll
                        for (int e = 0; e < DL / 2; ++e)
                            words[e] = pack2<T>(acc[2 * e][mf][nf][2 * h + jj], acc[2 * e + 1][mf][nf][2 * h + jj]);
                        T* at = out + jj * d;
                        if constexpr (DL == 2) *reinterpret_cast<uint32_t*>(at) = words[0];
                        else if constexpr (DL == 4) *reinterpret_cast<uint2*>(at) = make_uint2(words[0], words[1]);
                        else *reinterpret_cast<uint4*>(at) = make_uint4(words[0], words[1], words[2], words[3]);
                    }
                }
            }
}

template <typename T, int DL, int MF, int NF>
void launch_mma_tile(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                     cudaStream_t stream) {
    using Tile = MmaTile<DL, MF, NF>;
    const auto kernel = ksmm_mma_kernel<T, DL, MF, NF>;
    static const cudaError_t configured =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)Tile::kSmemBytes);
    (void)configured;
    const int64_t tiles = (b + Tile::kBn - 1) / Tile::kBn * ((tokens + Tile::kBm - 1) / Tile::kBm);
    const dim3 grid((unsigned)tiles, (unsigned)(a * (d / DL)));
    kernel<<<grid, kThreads, Tile::kSmemBytes, stream>>>(x, w, y, (int)tokens, (int)a, (int)b, (int)c, (int)d);
}

// The large tile when it fills at least 90% of the SMs with one block each, else the small one.
template <typename T, int DL, int MF, int NF, int SMALL_MF, int SMALL_NF>
void launch_mma_for(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                    cudaStream_t stream) {
    const int64_t large_blocks = (b + 32 * NF - 1) / (32 * NF) * ((tokens + 32 * MF - 1) / (32 * MF)) * a * (d / DL);
    if (large_blocks * 10 >= sm_count() * 9)
        launch_mma_tile<T, DL, MF, NF>(x, w, y, tokens, a, b, c, d, stream);
    else
        launch_mma_tile<T, DL, SMALL_MF, SMALL_NF>(x, w, y, tokens, a, b, c, d, stream);
}

}  // namespace

// MF * NF * DL = 16: 64 accumulators a thread (the tiles with 32 lost on monarch-50 prefill); the small tiles a
// quarter of the large ones.
template <typename T>
void launch_mma(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                cudaStream_t stream) {
    switch (d < 8 ? d : 8) {
        case 1: return launch_mma_for<T, 1, 4, 4, 2, 2>(x, w, y, tokens, a, b, c, d, stream);
        case 2: return launch_mma_for<T, 2, 4, 2, 2, 1>(x, w, y, tokens, a, b, c, d, stream);
        case 4: return launch_mma_for<T, 4, 2, 2, 1, 1>(x, w, y, tokens, a, b, c, d, stream);
        default: return launch_mma_for<T, 8, 2, 1, 1, 1>(x, w, y, tokens, a, b, c, d, stream);
    }
}

template void launch_mma<half>(const half*, const half*, half*, int64_t, int64_t, int64_t, int64_t, int64_t,
                               cudaStream_t);
template void launch_mma<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*, int64_t, int64_t,
                                        int64_t, int64_t, int64_t, cudaStream_t);

}  // namespace minfer::ksmm_detail
