// Launch of the block-sparse prefill kernels (blocksparse_attention.cuh).
#include "blocksparse_attention.cuh"

namespace minfer {

namespace {

constexpr float kLog2e = 1.4426950408889634f;

// The tensors' shape, for the tensor maps of the warp-specialized kernel.
struct Shape {
    int64_t batch, q_heads, kv_heads, seq_len;
    DType dtype;
};

// A [B, H, S, D] tensor as a 4-D tensor map (D innermost), boxes of 64 columns x one 64-row tile with
// the 128-byte swizzle: one box is one panel of a swizzled tile. Rows past S load as zeros.
template <int D>
bool tile_map(CUtensorMap* map, const void* ptr, AttnStrides strides, int64_t batch, int64_t heads, int64_t seq_len,
              DType dtype) {
    const cuuint64_t dims[4] = {D, (cuuint64_t)seq_len, (cuuint64_t)heads, (cuuint64_t)batch};
    const cuuint64_t byte_strides[3] = {(cuuint64_t)strides.seq * 2, (cuuint64_t)strides.head * 2,
                                        (cuuint64_t)strides.batch * 2};
    const cuuint32_t box[4] = {64, kBlocksparseTile, 1, 1};
    return encode_swizzled_map(map, ptr, dtype, 4, dims, byte_strides, box);
}

template <typename T, int D>
const char* launch_ws(const blocksparse::Params& params, const Shape& shape, BlocksparseKernel which,
                      cudaStream_t stream) {
    CUtensorMap map_q, map_k, map_v;
    if (!tile_map<D>(&map_q, params.q, params.q_strides, shape.batch, shape.q_heads, shape.seq_len, shape.dtype) ||
        !tile_map<D>(&map_k, params.k, params.k_strides, shape.batch, shape.kv_heads, shape.seq_len, shape.dtype) ||
        !tile_map<D>(&map_v, params.v, params.v_strides, shape.batch, shape.kv_heads, shape.seq_len, shape.dtype))
        return "cuTensorMapEncodeTiled failed (a driver without TMA, or strides it does not take)";
    auto kernel = which == BlocksparseKernel::kWsNoPingPong ? blocksparse::prefill_ws_kernel<T, D, false>
                                                            : blocksparse::prefill_ws_kernel<T, D, true>;
    constexpr int smem = blocksparse::WsSmem<D>::kBytes;  // 193 KB at D 128
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    const int64_t items = (params.q_tiles + 1) / 2 * shape.q_heads * shape.batch;
    const int64_t sms = multiprocessors(current_device());
    const int64_t grid = which == BlocksparseKernel::kWsGrid || items < sms ? items : sms;
    kernel<<<(unsigned)grid, blocksparse::kWsThreads, smem, stream>>>(params, map_q, map_k, map_v);
    return nullptr;
}

template <typename T, int D>
const char* launch_prefill(const blocksparse::Params& params, const Shape& shape, BlocksparseKernel which,
                           cudaStream_t stream) {
    if (which == BlocksparseKernel::kWs || which == BlocksparseKernel::kWsGrid ||
        which == BlocksparseKernel::kWsNoPingPong)
        return launch_ws<T, D>(params, shape, which, stream);
    const bool wgmma = which == BlocksparseKernel::kWgmma;
    auto kernel = wgmma ? blocksparse::prefill_wgmma_kernel<T, D> : blocksparse::prefill_mma_kernel<T, D>;
    const int threads = wgmma ? blocksparse::kWgmmaThreads : blocksparse::kMmaThreads;
    constexpr int smem = blocksparse::smem_bytes<T, D>();  // 97 KB at D 128
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);  // per device
    const dim3 grid((params.q_tiles + 1) / 2, (unsigned)shape.q_heads, (unsigned)shape.batch);
    kernel<<<grid, threads, smem, stream>>>(params);
    return nullptr;
}

template <typename T>
const char* launch_for_dim(const blocksparse::Params& params, int64_t head_dim, const Shape& shape,
                           BlocksparseKernel which, cudaStream_t stream) {
    if (head_dim == 64) return launch_prefill<T, 64>(params, shape, which, stream);
    return launch_prefill<T, 128>(params, shape, which, stream);
}

bool device_is_sm90() {
    int device = 0, major = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    return major == 9;
}

}  // namespace

const char* launch_blocksparse_attention(const void* q, AttnStrides q_strides, const void* k, AttnStrides k_strides,
                                         const void* v, AttnStrides v_strides, void* out, AttnStrides out_strides,
                                         const int* tile_ptr, const int* key_tiles, int64_t batch, int64_t q_heads,
                                         int64_t kv_heads, int64_t layout_heads, int64_t seq_len, int64_t head_dim,
                                         float scale, DType dtype, BlocksparseKernel kernel, cudaStream_t stream) {
    blocksparse::Params params{q, k, v, out, tile_ptr, key_tiles, q_strides, k_strides, v_strides, out_strides,
                               (int)batch, (int)seq_len, (int)((seq_len + kBlocksparseTile - 1) / kBlocksparseTile),
                               (int)q_heads, (int)kv_heads, (int)layout_heads, scale * kLog2e};
    const Shape shape{batch, q_heads, kv_heads, seq_len, dtype};
    auto launch = [&](BlocksparseKernel which) {
        return dtype == DType::kFloat16 ? launch_for_dim<half>(params, head_dim, shape, which, stream)
                                        : launch_for_dim<__nv_bfloat16>(params, head_dim, shape, which, stream);
    };
    if (kernel != BlocksparseKernel::kAuto) return launch(kernel);
    if (!device_is_sm90()) return launch(BlocksparseKernel::kMma);
    // ws-grid was the fastest at 16k dense causal and close at the sparse layouts (docs/perf-notes.md); where
    // the TMA maps cannot describe the tensors it launches nothing, and the wgmma kernel runs instead.
    return launch(BlocksparseKernel::kWsGrid) == nullptr ? nullptr : launch(BlocksparseKernel::kWgmma);
}

}  // namespace minfer
