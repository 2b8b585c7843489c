// Launch of the block-sparse prefill kernel (blocksparse_attention.cuh).
#include "blocksparse_attention.cuh"

namespace minfer {

namespace {

constexpr float kLog2e = 1.4426950408889634f;

template <typename T, int D>
void launch_prefill(const blocksparse::Params& params, int64_t batch, int64_t q_heads, cudaStream_t stream) {
    auto kernel = blocksparse::prefill_kernel<T, D>;
    // Q (128 rows) plus two stages of K and V (64 rows each): 96 KB at D 128, two blocks per SM.
    const int smem_bytes = (blocksparse::kQueryRows + 2 * 2 * blocksparse::kTile) * D * (int)sizeof(T);
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);  // per device
    const dim3 grid((params.q_tiles + 1) / 2, (unsigned)q_heads, (unsigned)batch);
    kernel<<<grid, blocksparse::kThreads, smem_bytes, stream>>>(params);
}

template <typename T>
void launch_for_dim(const blocksparse::Params& params, int64_t head_dim, int64_t batch, int64_t q_heads,
                    cudaStream_t stream) {
    if (head_dim == 64)
        launch_prefill<T, 64>(params, batch, q_heads, stream);
    else
        launch_prefill<T, 128>(params, batch, q_heads, stream);
}

}  // namespace

void launch_blocksparse_attention(const void* q, AttnStrides q_strides, const void* k, AttnStrides k_strides,
                                  const void* v, AttnStrides v_strides, void* out, AttnStrides out_strides,
                                  const int* tile_ptr, const int* key_tiles, int64_t batch, int64_t q_heads,
                                  int64_t kv_heads, int64_t layout_heads, int64_t seq_len, int64_t head_dim,
                                  float scale, DType dtype, cudaStream_t stream) {
    blocksparse::Params params{q, k, v, out, tile_ptr, key_tiles, q_strides, k_strides, v_strides, out_strides,
                               (int)seq_len, (int)((seq_len + kBlocksparseTile - 1) / kBlocksparseTile),
                               (int)q_heads, (int)kv_heads, (int)layout_heads, scale * kLog2e};
    if (dtype == DType::kFloat16)
        launch_for_dim<half>(params, head_dim, batch, q_heads, stream);
    else
        launch_for_dim<__nv_bfloat16>(params, head_dim, batch, q_heads, stream);
}

}  // namespace minfer
