// Launch of the block-sparse prefill kernels (blocksparse_attention.cuh).
#include "blocksparse_attention.cuh"

namespace minfer {

namespace {

constexpr float kLog2e = 1.4426950408889634f;

template <typename T, int D>
void launch_prefill(const blocksparse::Params& params, int64_t batch, int64_t q_heads, BlocksparseKernel which,
                    cudaStream_t stream) {
    const bool wgmma = which == BlocksparseKernel::kWgmma;
    auto kernel = wgmma ? blocksparse::prefill_wgmma_kernel<T, D> : blocksparse::prefill_mma_kernel<T, D>;
    const int threads = wgmma ? blocksparse::kWgmmaThreads : blocksparse::kMmaThreads;
    constexpr int smem = blocksparse::smem_bytes<T, D>();  // 97 KB at D 128
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);  // per device
    const dim3 grid((params.q_tiles + 1) / 2, (unsigned)q_heads, (unsigned)batch);
    kernel<<<grid, threads, smem, stream>>>(params);
}

template <typename T>
void launch_for_dim(const blocksparse::Params& params, int64_t head_dim, int64_t batch, int64_t q_heads,
                    BlocksparseKernel which, cudaStream_t stream) {
    if (head_dim == 64)
        launch_prefill<T, 64>(params, batch, q_heads, which, stream);
    else
        launch_prefill<T, 128>(params, batch, q_heads, which, stream);
}

bool device_is_sm90() {
    int device = 0, major = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    return major == 9;
}

}  // namespace

void launch_blocksparse_attention(const void* q, AttnStrides q_strides, const void* k, AttnStrides k_strides,
                                  const void* v, AttnStrides v_strides, void* out, AttnStrides out_strides,
                                  const int* tile_ptr, const int* key_tiles, int64_t batch, int64_t q_heads,
                                  int64_t kv_heads, int64_t layout_heads, int64_t seq_len, int64_t head_dim,
                                  float scale, DType dtype, BlocksparseKernel kernel, cudaStream_t stream) {
    blocksparse::Params params{q, k, v, out, tile_ptr, key_tiles, q_strides, k_strides, v_strides, out_strides,
                               (int)seq_len, (int)((seq_len + kBlocksparseTile - 1) / kBlocksparseTile),
                               (int)q_heads, (int)kv_heads, (int)layout_heads, scale * kLog2e};
    if (kernel == BlocksparseKernel::kAuto)
        kernel = device_is_sm90() ? BlocksparseKernel::kWgmma : BlocksparseKernel::kMma;
    if (dtype == DType::kFloat16)
        launch_for_dim<half>(params, head_dim, batch, q_heads, kernel, stream);
    else
        launch_for_dim<__nv_bfloat16>(params, head_dim, batch, q_heads, kernel, stream);
}

}  // namespace minfer
