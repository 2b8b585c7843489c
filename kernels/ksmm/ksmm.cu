// KS factor products (ksmm.h): three kernels behind one launcher.
// - rows (1-16 tokens): a group of threads per output row (i, j) streams W[i][j][:][:] (c*d contiguous
//   values) once in 16-byte vectors against x[n][i][:][:] (contiguous too). Element p of the run belongs to
//   l = p mod d; with d a power of two dividing 8 * group, a thread always meets the same l's, so it keeps 8
//   fp32 sums per token and the group reduces them by shuffles (and shared memory past one warp).
// - tensor cores (more tokens): per (i, group of DL l's) a GEMM tile Y[n0.., i, j0.., l] over k, mma.sync
//   m16n8k16. Tiles of x and W are read as their contiguous (k x d) runs in 16-byte chunks and scattered
//   into one shared-memory plane per l (k contiguous), so ldmatrix feeds the mma; no permutation copy.
// - generic: one thread per output, any pattern and alignment (odd d or c*d, the contract's samples).
#include <cooperative_groups.h>

#include <algorithm>

#include "common/device_utils.cuh"
#include "ksmm/ksmm.h"

namespace minfer {

namespace {

constexpr int kThreads = 256;
constexpr int kRowsUnroll = 4;  // 16-byte weight vectors per thread in flight

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const float2 pair = pair_to_float2<T>(words[q]);
        f[2 * q] = pair.x;
        f[2 * q + 1] = pair.y;
    }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
bool power_of_two(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

int sm_count() {
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    return std::max(sms, 1);
}

// ---------------------------------------------------------------------------------------------------------
// rows: the bandwidth path
// ---------------------------------------------------------------------------------------------------------

template <typename T, int TOKENS>
__global__ void __launch_bounds__(kThreads) ksmm_rows_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                            T* __restrict__ y, int tokens, int a, int b, int c,
                                                            int d, int group) {
    __shared__ float partial[kThreads / 32][TOKENS][kKsmmRowsMaxD];
    const int64_t row_len = (int64_t)c * d, rows = (int64_t)a * b;
    const int vectors = (int)(row_len / 8);
    const int t = threadIdx.x % group;
    const int64_t row = (int64_t)blockIdx.x * (kThreads / group) + threadIdx.x / group;
    float acc[TOKENS][8] = {};
    if (row < rows) {
        const uint4* w_row = reinterpret_cast<const uint4*>(w + row * row_len);
        const uint4* x_row = reinterpret_cast<const uint4*>(x + row / b * row_len);
        const int64_t token_stride = (int64_t)a * vectors;  // in vectors
        for (int first = t; first < vectors; first += kRowsUnroll * group) {
            uint4 wv[kRowsUnroll];
#pragma unroll
            for (int u = 0; u < kRowsUnroll; ++u) {
                const int v = first + u * group;
                wv[u] = v < vectors ? load_stream_16B(w_row + v) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < kRowsUnroll; ++u) {
                const int v = first + u * group;
                if (v < vectors) {
                    float wf[8];
                    unpack8<T>(wv[u], wf);
#pragma unroll
                    for (int n = 0; n < TOKENS; ++n) {
                        if (TOKENS == 1 || n < tokens) {
                            float xf[8];
                            unpack8<T>(__ldg(x_row + n * token_stride + v), xf);
#pragma unroll
                            for (int e = 0; e < 8; ++e) acc[n][e] = fmaf(wf[e], xf[e], acc[n][e]);
                        }
                    }
                }
            }
        }
    }
    // Element e of a thread's vectors is l = (8 t + e) mod d: fold e onto e mod d when d < 8.
#pragma unroll
    for (int n = 0; n < TOKENS; ++n) {
#pragma unroll
        for (int half = 4; half >= 1; half >>= 1)
            if (d <= half)
#pragma unroll
                for (int e = 0; e < half; ++e) acc[n][e] += acc[n][e + half];
    }
    const int slots = d < 8 ? d : 8;
    const int owners = d < 8 ? 1 : d / 8;  // threads t and t' hold the same l's when t = t' mod owners
    const int width = group < 32 ? group : 32;
    for (int offset = width / 2; offset >= owners; offset >>= 1)
#pragma unroll
        for (int n = 0; n < TOKENS; ++n)
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (e < slots) acc[n][e] += __shfl_xor_sync(0xffffffffu, acc[n][e], offset);
    const int64_t out_stride = rows * d;  // y's token stride
    if (group <= 32) {
        if (row < rows && t < owners)
#pragma unroll
            for (int n = 0; n < TOKENS; ++n)
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (e < slots && (TOKENS == 1 || n < tokens))
                        y[n * out_stride + row * d + 8 * t + e] = from_float<T>(acc[n][e]);
        return;
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane < owners)
#pragma unroll
        for (int n = 0; n < TOKENS; ++n)
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (e < slots) partial[warp][n][8 * lane + e] = acc[n][e];
    __syncthreads();
    const int first_warp = threadIdx.x / group * (group / 32);
    if (row < rows)
        for (int o = t; o < tokens * d; o += group) {
            const int n = o / d, l = o % d;
            float sum = 0.f;
            for (int k = 0; k < group / 32; ++k) sum += partial[first_warp + k][n][l];  // fixed order
            y[n * out_stride + row * d + l] = from_float<T>(sum);
        }
}

// Threads per row: about one round of kRowsUnroll vectors each, at least enough to give every l an owner.
int rows_group(int64_t c, int64_t d) {
    const int64_t vectors = c * d / 8, owners = d < 8 ? 1 : d / 8;
    int group = 8;
    while (group < kThreads && (int64_t)group * kRowsUnroll < vectors) group *= 2;
    return (int)std::max<int64_t>(group, owners);
}

template <typename T, int TOKENS>
void launch_rows(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                 cudaStream_t stream) {
    const int group = rows_group(c, d);
    const int64_t rows_per_block = kThreads / group;
    const int64_t blocks = (a * b + rows_per_block - 1) / rows_per_block;
    ksmm_rows_kernel<T, TOKENS><<<(unsigned)blocks, kThreads, 0, stream>>>(x, w, y, (int)tokens, (int)a, (int)b,
                                                                          (int)c, (int)d, group);
}

// ---------------------------------------------------------------------------------------------------------
// gemv: the bandwidth path on the tensor cores
// ---------------------------------------------------------------------------------------------------------

constexpr int kGemvMaxWarps = 8;
constexpr int kGemvMaxSplits = 8;  // blocks of one tile: a portable cluster
constexpr int kGemvChunks = 4;  // 16-byte chunks of each of its rows a lane loads per step

// 16 bits of a 16-byte chunk: element e.
__device__ __forceinline__ uint32_t chunk_word(const uint4& chunk, int word) {
    return word == 0 ? chunk.x : word == 1 ? chunk.y : word == 2 ? chunk.z : chunk.w;
}

// Values v and v + 1 of plane l among a lane's kGemvChunks chunks, packed low first: value v is element
// (v % (8 / DL)) * DL + l of chunk v / (8 / DL), i.e. the lane's k's of that l in order. Every index is a
// compile-time constant once the callers' loops are unrolled, so this is one PRMT.
template <int DL>
__device__ __forceinline__ uint32_t pack_plane_pair(const uint4 (&chunks)[kGemvChunks], int l, int v) {
    constexpr int per_chunk = 8 / DL;
    const int e0 = v % per_chunk * DL + l, e1 = (v + 1) % per_chunk * DL + l;
    const uint32_t lo = chunk_word(chunks[v / per_chunk], e0 / 2), hi = chunk_word(chunks[(v + 1) / per_chunk], e1 / 2);
    return __byte_perm(lo, hi, (e0 % 2 ? 0x32u : 0x10u) | (e1 % 2 ? 0x7600u : 0x5400u));
}

// A cluster of `splits` blocks per tile: 16 rows j of one i (and, for d > 8, one group of 8 l's); the
// cluster's warps split the row into steps of 16 chunks per row (few tiles then still fill the GPU). Lane (g, t) loads chunks step * 16 + 4 q + t (q < 4) of rows j0 + g and
// j0 + g + 8 and of x for token g (and g + 8), so each load instruction reads 64 contiguous bytes per row.
// A chunk holds 8 / DL k's times DL l's (d <= 8: the row's elements u * 8 ..; d > 8: k = u, l's 8 G ..).
// Per l, a lane's 32 / DL values of that l feed 8 / DL mma.m16n8k16 (A: the 16 rows, B: the tokens) in a
// k-slot order that depends on t alone, the same for A and B, so each dot product is exact in any order.
// The warps' fp32 sums meet in shared memory; the cluster's first block adds them in block then warp order
// (deterministic), reading the others' through distributed shared memory. Launched as a programmatic
// dependent (PDL): the first weights are on the way before the previous kernel ends; x waits for it.
template <typename T, int DL, int NT>
__global__ void __launch_bounds__(kGemvMaxWarps * 32) ksmm_gemv_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                                      T* __restrict__ y, int tokens, int a, int b,
                                                                      int c, int d, int splits) {
    constexpr int kAcc = DL * NT * 4;
    constexpr int kSteps = NT == 1 ? 2 : 1;  // steps in flight per warp
    extern __shared__ float partial[];       // [warps][kAcc][32]
    const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int groups = DL == 8 ? d / 8 : 1;
    const int j_tiles = (b + 15) / 16;
    const int split = blockIdx.x % splits, tile = blockIdx.x / splits;
    const int group = tile % groups, j0 = tile / groups % j_tiles * 16, i = tile / groups / j_tiles;
    const int cluster_warps = splits * warps;
    const int64_t row_len = (int64_t)c * d, l0 = DL == 8 ? 8 * group : 0;
    const int units = DL == 8 ? c : (int)(row_len / 8);  // chunks along the row (of this l group)
    const int steps = (units + 15) / 16;
    // Rows past b and tokens past the batch load row / token 0 and drop it (loads without branches stay in
    // flight together).
    const bool lo_ok = j0 + g < b, hi_ok = j0 + g + 8 < b, x_lo_ok = g < tokens, x_hi_ok = g + 8 < tokens;
    const T* w_lo = w + ((int64_t)i * b + (lo_ok ? j0 + g : 0)) * row_len + l0;
    const T* w_hi = w + ((int64_t)i * b + (hi_ok ? j0 + g + 8 : 0)) * row_len + l0;
    const T* x_lo = x + ((int64_t)(x_lo_ok ? g : 0) * a + i) * row_len + l0;
    const T* x_hi = x + ((int64_t)(x_hi_ok ? g + 8 : 0) * a + i) * row_len + l0;
    const auto offset = [&](int u) { return DL == 8 ? (int64_t)u * d : (int64_t)u * 8; };
    const auto keep = [](bool ok, const uint4& v) { return ok ? v : make_uint4(0, 0, 0, 0); };

    allow_dependents_to_launch();
    float acc[DL][NT][4] = {};
    bool waited = false;
    for (int first = split * warps + warp; first < steps; first += cluster_warps * kSteps) {
        uint4 wl[kSteps][kGemvChunks], wh[kSteps][kGemvChunks], xl[kSteps][kGemvChunks], xh[NT == 2 ? kSteps : 1][kGemvChunks];
#pragma unroll
        for (int s = 0; s < kSteps; ++s)
#pragma unroll
            for (int q = 0; q < kGemvChunks; ++q) {
                const int step = first + s * cluster_warps, u = step * 16 + q * 4 + t;
                const bool valid = step < steps && u < units;
                const int64_t at = valid ? offset(u) : 0;
                wl[s][q] = keep(valid && lo_ok, load_stream_16B(w_lo + at));
                wh[s][q] = keep(valid && hi_ok, load_stream_16B(w_hi + at));
            }
        if (!waited) {
            wait_for_previous_kernel();  // x may come from it: coherent loads from here on
            waited = true;
        }
#pragma unroll
        for (int s = 0; s < kSteps; ++s)
#pragma unroll
            for (int q = 0; q < kGemvChunks; ++q) {
                const int step = first + s * cluster_warps, u = step * 16 + q * 4 + t;
                const bool valid = step < steps && u < units;
                const int64_t at = valid ? offset(u) : 0;
                xl[s][q] = keep(valid && x_lo_ok, load_coherent_16B(x_lo + at));
                if constexpr (NT == 2) xh[s][q] = keep(valid && x_hi_ok, load_coherent_16B(x_hi + at));
            }
#pragma unroll
        for (int s = 0; s < kSteps; ++s)
#pragma unroll
            for (int l = 0; l < DL; ++l)
#pragma unroll
                for (int m = 0; m < 8 / DL; ++m) {
                    const uint32_t af[4] = {pack_plane_pair<DL>(wl[s], l, 4 * m), pack_plane_pair<DL>(wh[s], l, 4 * m),
                                            pack_plane_pair<DL>(wl[s], l, 4 * m + 2),
                                            pack_plane_pair<DL>(wh[s], l, 4 * m + 2)};
                    mma_m16n8k16<T>(acc[l][0], af, pack_plane_pair<DL>(xl[s], l, 4 * m),
                                    pack_plane_pair<DL>(xl[s], l, 4 * m + 2));
                    if constexpr (NT == 2)
                        mma_m16n8k16<T>(acc[l][NT - 1], af, pack_plane_pair<DL>(xh[s], l, 4 * m),
                                        pack_plane_pair<DL>(xh[s], l, 4 * m + 2));
                }
    }
#pragma unroll
    for (int l = 0; l < DL; ++l)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) partial[(warp * kAcc + (l * NT + nt) * 4 + r) * 32 + lane] = acc[l][nt][r];
    wait_for_previous_kernel();  // y too may be read by it (warps without steps never waited above)
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    // C fragment: c0, c1 = row g, tokens 2t, 2t + 1 of the n-tile; c2, c3 = row g + 8.
    if (cluster.block_rank() == 0)
        for (int e = threadIdx.x; e < kAcc * 32; e += blockDim.x) {
            const int idx = e / 32, owner = e % 32, r = idx % 4, nt = idx / 4 % NT, l = idx / (4 * NT);
            const int j = j0 + owner / 4 + (r >= 2 ? 8 : 0), n = nt * 8 + 2 * (owner % 4) + (r & 1);
            if (j >= b || n >= tokens) continue;
            float sum = 0.f;
            for (int rank = 0; rank < splits; ++rank) {
                const float* sums = cluster.map_shared_rank(partial, rank);
                for (int k = 0; k < warps; ++k) sum += sums[(k * kAcc + idx) * 32 + owner];
            }
            y[(((int64_t)n * a + i) * b + j) * d + l0 + l] = from_float<T>(sum);
        }
    cluster.sync();  // the other blocks' shared memory stays until the first block has read it
}

template <typename T, int DL, int NT>
void launch_gemv_tile(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                      cudaStream_t stream) {
    const auto kernel = ksmm_gemv_kernel<T, DL, NT>;
    constexpr int kMaxSmem = kGemvMaxWarps * DL * NT * 4 * 32 * (int)sizeof(float);
    static const cudaError_t configured =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem);
    (void)configured;
    const int64_t units = DL == 8 ? c : c * d / 8, steps = (units + 15) / 16;
    const int warps = (int)std::min<int64_t>(kGemvMaxWarps, steps);
    const int64_t tiles = a * ((b + 15) / 16) * (DL == 8 ? d / 8 : 1);
    // Blocks per tile: enough for two blocks per SM, each warp keeping at least one step.
    const int64_t wanted = (2 * sm_count() + tiles - 1) / tiles, useful = (steps + warps - 1) / warps;
    const int splits = (int)std::max<int64_t>(1, std::min<int64_t>({kGemvMaxSplits, wanted, useful}));
    cudaLaunchAttribute attributes[2];
    attributes[0].id = cudaLaunchAttributeClusterDimension;
    attributes[0].val.clusterDim.x = splits;
    attributes[0].val.clusterDim.y = 1;
    attributes[0].val.clusterDim.z = 1;
    attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[1].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3((unsigned)(tiles * splits));
    config.blockDim = dim3(warps * 32);
    config.dynamicSmemBytes = warps * DL * NT * 4 * 32 * sizeof(float);
    config.stream = stream;
    config.attrs = attributes;
    config.numAttrs = device_supports_pdl() ? 2 : 1;
    cudaLaunchKernelEx(&config, kernel, x, w, y, (int)tokens, (int)a, (int)b, (int)c, (int)d, splits);
}

template <typename T, int DL>
void launch_gemv_for(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                     cudaStream_t stream) {
    if (tokens <= 8)
        launch_gemv_tile<T, DL, 1>(x, w, y, tokens, a, b, c, d, stream);
    else
        launch_gemv_tile<T, DL, 2>(x, w, y, tokens, a, b, c, d, stream);
}

template <typename T>
void launch_gemv(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                 cudaStream_t stream) {
    switch (d < 8 ? d : 8) {
        case 1: return launch_gemv_for<T, 1>(x, w, y, tokens, a, b, c, d, stream);
        case 2: return launch_gemv_for<T, 2>(x, w, y, tokens, a, b, c, d, stream);
        case 4: return launch_gemv_for<T, 4>(x, w, y, tokens, a, b, c, d, stream);
        default: return launch_gemv_for<T, 8>(x, w, y, tokens, a, b, c, d, stream);
    }
}

// ---------------------------------------------------------------------------------------------------------
// tensor cores
// ---------------------------------------------------------------------------------------------------------

constexpr int kTileK = 32;              // k per pipeline stage
constexpr int kPlaneLd = kTileK + 8;    // a plane row in halves: 80 B, so ldmatrix's 8 rows hit distinct banks

// A 16-byte chunk holds (8 / DL) consecutive k times DL consecutive l: element kk * DL + ll goes to plane ll,
// column col + kk.
template <int DL>
__device__ __forceinline__ void scatter_chunk(uint16_t* plane0, int plane_stride, int row, int col, const uint4& v) {
    uint16_t* at = plane0 + row * kPlaneLd + col;
    if constexpr (DL == 1) {
        *reinterpret_cast<uint4*>(at) = v;
    } else if constexpr (DL == 2) {
        *reinterpret_cast<uint2*>(at) = make_uint2(__byte_perm(v.x, v.y, 0x5410), __byte_perm(v.z, v.w, 0x5410));
        *reinterpret_cast<uint2*>(at + plane_stride) =
            make_uint2(__byte_perm(v.x, v.y, 0x7632), __byte_perm(v.z, v.w, 0x7632));
    } else if constexpr (DL == 4) {
        *reinterpret_cast<uint32_t*>(at) = __byte_perm(v.x, v.z, 0x5410);
        *reinterpret_cast<uint32_t*>(at + plane_stride) = __byte_perm(v.x, v.z, 0x7632);
        *reinterpret_cast<uint32_t*>(at + 2 * plane_stride) = __byte_perm(v.y, v.w, 0x5410);
        *reinterpret_cast<uint32_t*>(at + 3 * plane_stride) = __byte_perm(v.y, v.w, 0x7632);
    } else {
        const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int ll = 0; ll < 8; ++ll) at[ll * plane_stride] = (uint16_t)(words[ll / 2] >> (16 * (ll % 2)));
    }
}

// A tile of BM = 32 MF tokens by BN = 32 NF outputs j for DL l's of one i; 8 warps as 2 x 4, each
// (16 MF) x (8 NF) per l. Shared memory: two buffers of DL planes of BM rows of x then BN rows of W, and
// kStages raw tiles that cp.async fills kStages - 1 k-steps ahead; each thread moves the chunks it copied
// from its raw slots into the planes (so only the planes need a barrier).
template <int DL, int MF, int NF>
struct MmaTile {
    static constexpr int kBm = 32 * MF, kBn = 32 * NF;
    static constexpr int kKPerChunk = 8 / DL, kChunksPerRow = kTileK / kKPerChunk;
    static constexpr int kAChunks = kBm * kChunksPerRow / kThreads, kBChunks = kBn * kChunksPerRow / kThreads;
    static constexpr int kPlane = (kBm + kBn) * kPlaneLd;  // halves
    static constexpr int kStage = DL * kPlane;             // one buffer of DL planes, in halves
    static constexpr size_t kPlanesBytes = 2 * kStage * sizeof(uint16_t);
    // Tiles as loaded (16-byte chunks, (kBm + kBn) rows of kChunksPerRow), kStages of them in flight.
    static constexpr int kStages = DL == 8 ? 2 : DL == 4 ? 3 : 4;
    static constexpr int kRawStage = (kBm + kBn) * kChunksPerRow;  // chunks
    static constexpr size_t kSmemBytes = kPlanesBytes + kStages * kRawStage * sizeof(uint4);
    static_assert(kBm * kChunksPerRow % kThreads == 0 && kBn * kChunksPerRow % kThreads == 0, "whole chunks");
};

template <typename T, int DL, int MF, int NF>
__global__ void __launch_bounds__(kThreads) ksmm_mma_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                           T* __restrict__ y, int tokens, int a, int b, int c,
                                                           int d) {
    using Tile = MmaTile<DL, MF, NF>;
    constexpr int kBm = Tile::kBm, kBn = Tile::kBn, kKPerChunk = Tile::kKPerChunk;
    extern __shared__ uint4 smem_raw[];
    uint16_t* smem = reinterpret_cast<uint16_t*>(smem_raw);

    const int l_groups = d / DL;
    const int i = blockIdx.y / l_groups, l0 = blockIdx.y % l_groups * DL;
    const int j_tiles = (b + kBn - 1) / kBn;
    const int n0 = blockIdx.x / j_tiles * kBm, j0 = blockIdx.x % j_tiles * kBn;
    const int64_t row_len = (int64_t)c * d;

    // Chunk u of a thread: row (threadIdx.x + u * kThreads) / kChunksPerRow of the tile, fixed over the k loop.
    const auto chunk_row = [](int u) { return (int)(threadIdx.x + u * kThreads) / Tile::kChunksPerRow; };
    const auto chunk_col = [](int u) { return (int)(threadIdx.x + u * kThreads) % Tile::kChunksPerRow * kKPerChunk; };
    const T* a_base[Tile::kAChunks];
#pragma unroll
    for (int u = 0; u < Tile::kAChunks; ++u) {
        const int n = n0 + chunk_row(u);
        a_base[u] = n < tokens ? x + ((int64_t)n * a + i) * row_len + l0 : nullptr;
    }
    const T* b_base[Tile::kBChunks];
#pragma unroll
    for (int u = 0; u < Tile::kBChunks; ++u) {
        const int j = j0 + chunk_row(u);
        b_base[u] = j < b ? w + ((int64_t)i * b + j) * row_len + l0 : nullptr;
    }
    // A thread's chunk u of x sits at raw slot threadIdx.x + u * kThreads, of W kBm * kChunksPerRow further.
    uint4* raw = reinterpret_cast<uint4*>(reinterpret_cast<char*>(smem_raw) + Tile::kPlanesBytes);
    const auto issue = [&](int kt) {
        uint4* slots = raw + kt % Tile::kStages * Tile::kRawStage + threadIdx.x;
#pragma unroll
        for (int u = 0; u < Tile::kAChunks; ++u) {
            const int k = kt * kTileK + chunk_col(u);
            const bool valid = a_base[u] && k < c;
            cp_async_16(smem_addr(slots + u * kThreads), valid ? a_base[u] + (int64_t)k * d : x, valid);
        }
#pragma unroll
        for (int u = 0; u < Tile::kBChunks; ++u) {
            const int k = kt * kTileK + chunk_col(u);
            const bool valid = b_base[u] && k < c;
            cp_async_16(smem_addr(slots + kBm * Tile::kChunksPerRow + u * kThreads),
                        valid ? b_base[u] + (int64_t)k * d : w, valid);
        }
    };
    const auto transpose = [&](int kt) {
        const uint4* slots = raw + kt % Tile::kStages * Tile::kRawStage + threadIdx.x;
        uint16_t* planes = smem + (kt & 1) * Tile::kStage;
#pragma unroll
        for (int u = 0; u < Tile::kAChunks; ++u)
            scatter_chunk<DL>(planes, Tile::kPlane, chunk_row(u), chunk_col(u), slots[u * kThreads]);
#pragma unroll
        for (int u = 0; u < Tile::kBChunks; ++u)
            scatter_chunk<DL>(planes, Tile::kPlane, kBm + chunk_row(u), chunk_col(u),
                              slots[kBm * Tile::kChunksPerRow + u * kThreads]);
    };

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int warp_m = warp / 4 * 16 * MF, warp_n = warp % 4 * 8 * NF;
    float acc[DL][MF][NF][4] = {};
    const auto compute = [&](int stage) {
#pragma unroll
        for (int l = 0; l < DL; ++l) {
            const uint16_t* a_plane = smem + stage * Tile::kStage + l * Tile::kPlane;
            const uint16_t* b_plane = a_plane + kBm * kPlaneLd;
#pragma unroll
            for (int ks = 0; ks < kTileK; ks += 16) {
                uint32_t af[MF][4];
#pragma unroll
                for (int mf = 0; mf < MF; ++mf)
                    ldmatrix_x4(af[mf], smem_addr(a_plane + (warp_m + mf * 16 + lane % 16) * kPlaneLd + ks +
                                                  lane / 16 * 8));
                uint32_t bf[NF][2];
#pragma unroll
                for (int nf = 0; nf < NF; nf += 2) {
                    // matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
                    const int n_row = warp_n + nf * 8 + lane % 8 + (nf + 1 < NF ? lane / 16 * 8 : 0);
                    uint32_t r[4];
                    ldmatrix_x4(r, smem_addr(b_plane + n_row * kPlaneLd + ks + lane / 8 % 2 * 8));
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
                    for (int nf = 0; nf < NF; ++nf) mma_m16n8k16<T>(acc[l][mf][nf], af[mf], bf[nf][0], bf[nf][1]);
            }
        }
    };

    const int k_tiles = (c + kTileK - 1) / kTileK;
#pragma unroll
    for (int kt = 0; kt < Tile::kStages - 1; ++kt) {
        if (kt < k_tiles) issue(kt);
        cp_async_commit();
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
        cp_async_wait<Tile::kStages - 2>();  // this thread's chunks of k-step kt are in
        // planes kt & 1 were last read by compute(kt - 2), which every thread finished before the barrier of kt - 1
        transpose(kt);
        if (kt + Tile::kStages - 1 < k_tiles) issue(kt + Tile::kStages - 1);  // into the slots transpose(kt - 1) read
        cp_async_commit();
        __syncthreads();
        compute(kt & 1);
    }

    // c0, c1: token lane / 4, outputs j, j + 1 with j = 2 (lane % 4); c2, c3: token + 8.
#pragma unroll
    for (int l = 0; l < DL; ++l)
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
            for (int nf = 0; nf < NF; ++nf)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int n = n0 + warp_m + mf * 16 + lane / 4 + (r >= 2 ? 8 : 0);
                    const int j = j0 + warp_n + nf * 8 + 2 * (lane % 4) + (r & 1);
                    if (n < tokens && j < b)
                        y[(((int64_t)n * a + i) * b + j) * d + l0 + l] = from_float<T>(acc[l][mf][nf][r]);
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

// The large tile (MF * NF * DL = 16: 64 accumulators a thread) when it gives every SM a block, else the
// small one (a quarter of it), so that few tokens or few outputs still fill the GPU.
template <typename T, int DL, int MF, int NF, int SMALL_MF, int SMALL_NF>
void launch_mma_for(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                    cudaStream_t stream) {
    const int64_t large_blocks = (b + 32 * NF - 1) / (32 * NF) * ((tokens + 32 * MF - 1) / (32 * MF)) * a * (d / DL);
    if (large_blocks >= sm_count())
        launch_mma_tile<T, DL, MF, NF>(x, w, y, tokens, a, b, c, d, stream);
    else
        launch_mma_tile<T, DL, SMALL_MF, SMALL_NF>(x, w, y, tokens, a, b, c, d, stream);
}

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

// ---------------------------------------------------------------------------------------------------------
// generic
// ---------------------------------------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kThreads) ksmm_generic_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                               T* __restrict__ y, int64_t total, int a, int b,
                                                               int c, int d) {
    for (int64_t o = (int64_t)blockIdx.x * kThreads + threadIdx.x; o < total; o += (int64_t)gridDim.x * kThreads) {
        const int l = (int)(o % d);
        int64_t rest = o / d;
        const int j = (int)(rest % b);
        rest /= b;
        const int i = (int)(rest % a);
        const int64_t n = rest / a;
        const T* x_at = x + (n * a + i) * c * d + l;
        const T* w_at = w + ((int64_t)i * b + j) * c * d + l;
        float sum = 0.f;
        for (int k = 0; k < c; ++k) sum = fmaf(to_float(x_at[(int64_t)k * d]), to_float(w_at[(int64_t)k * d]), sum);
        y[o] = from_float<T>(sum);
    }
}

template <typename T>
void launch_typed(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                  KsmmPath path, cudaStream_t stream) {
    switch (path) {
        case KsmmPath::kRows:
            if (tokens <= 1) return launch_rows<T, 1>(x, w, y, tokens, a, b, c, d, stream);
            if (tokens <= 2) return launch_rows<T, 2>(x, w, y, tokens, a, b, c, d, stream);
            if (tokens <= 4) return launch_rows<T, 4>(x, w, y, tokens, a, b, c, d, stream);
            if (tokens <= 8) return launch_rows<T, 8>(x, w, y, tokens, a, b, c, d, stream);
            return launch_rows<T, 16>(x, w, y, tokens, a, b, c, d, stream);
        case KsmmPath::kGemv: return launch_gemv<T>(x, w, y, tokens, a, b, c, d, stream);
        case KsmmPath::kTensorCore: return launch_mma<T>(x, w, y, tokens, a, b, c, d, stream);
        default: {
            const int64_t total = tokens * a * b * d;
            const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65536);
            ksmm_generic_kernel<T><<<(unsigned)blocks, kThreads, 0, stream>>>(x, w, y, total, (int)a, (int)b, (int)c,
                                                                               (int)d);
        }
    }
}

}  // namespace

bool ksmm_path_supports(KsmmPath path, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d, const void* x,
                        const void* w, const void* y) {
    (void)y;  // every path writes y element by element
    const bool vectors = (c * d) % 8 == 0 && aligned16(x) && aligned16(w);
    switch (path) {
        case KsmmPath::kAuto:
        case KsmmPath::kGeneric: return true;
        case KsmmPath::kRows:
            return tokens <= kKsmmRowsMaxTokens && power_of_two(d) && d <= kKsmmRowsMaxD && vectors;
        case KsmmPath::kGemv:
            return tokens <= kKsmmRowsMaxTokens && (d == 1 || d == 2 || d == 4 || d % 8 == 0) && vectors;
        case KsmmPath::kTensorCore:
            return (d == 1 || d == 2 || d == 4 || d % 8 == 0) && vectors && a * (d < 8 ? 1 : d / 8) <= 65535;
    }
    return false;
}

KsmmPath ksmm_auto_path(int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d, const void* x, const void* w,
                        const void* y) {
    if (ksmm_path_supports(KsmmPath::kGemv, tokens, a, b, c, d, x, w, y)) return KsmmPath::kGemv;
    if (ksmm_path_supports(KsmmPath::kTensorCore, tokens, a, b, c, d, x, w, y)) return KsmmPath::kTensorCore;
    return KsmmPath::kGeneric;
}

void launch_ksmm(const void* x, const void* w, void* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                 KsmmPath path, DType dtype, cudaStream_t stream) {
    if (tokens == 0 || a * b * d == 0) return;
    if (c == 0) {
        cudaMemsetAsync(y, 0, tokens * a * b * d * 2, stream);
        return;
    }
    if (path == KsmmPath::kAuto) path = ksmm_auto_path(tokens, a, b, c, d, x, w, y);
    if (dtype == DType::kBFloat16)
        launch_typed(static_cast<const __nv_bfloat16*>(x), static_cast<const __nv_bfloat16*>(w),
                     static_cast<__nv_bfloat16*>(y), tokens, a, b, c, d, path, stream);
    else
        launch_typed(static_cast<const half*>(x), static_cast<const half*>(w), static_cast<half*>(y), tokens, a, b,
                     c, d, path, stream);
}

}  // namespace minfer
