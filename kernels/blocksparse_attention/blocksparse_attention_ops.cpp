// Op schema and CUDA binding of block-sparse attention: checks tensors and forwards raw pointers.
// Messages are literals: on the device image a TORCH_CHECK that streamed an integer crashed the process.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "blocksparse_attention.h"

namespace {

minfer::AttnStrides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// [B, H, S, D] with a contiguous last dim and rows that start on 16 bytes.
bool rows_aligned(const at::Tensor& t) {
    return t.is_cuda() && t.dim() == 4 && t.stride(3) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 &&
           t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0;
}

void run_blocksparse_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& tile_ptr, const at::Tensor& key_tiles, int64_t layout_heads,
                               double scale, at::Tensor& out, minfer::BlocksparseKernel kernel) {
    TORCH_CHECK(rows_aligned(q) && rows_aligned(k) && rows_aligned(v) && rows_aligned(out),
                "minfer.blocksparse_attention: q, k, v and out must be CUDA [B, H, S, D] tensors with a contiguous "
                "last dim and 16-byte aligned rows");
    const int64_t batch = q.size(0), q_heads = q.size(1), seq_len = q.size(2), head_dim = q.size(3);
    const int64_t kv_heads = k.size(1);
    TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == batch && k.size(2) == seq_len && k.size(3) == head_dim &&
                    out.sizes() == q.sizes(),
                "minfer.blocksparse_attention: k and v must be [B, Hkv, S, D] and out [B, Hq, S, D] for q's B, S, D");
    TORCH_CHECK(head_dim == 64 || head_dim == 128, "minfer.blocksparse_attention: head_dim must be 64 or 128");
    TORCH_CHECK(kv_heads >= 1 && q_heads % kv_heads == 0,
                "minfer.blocksparse_attention: the query heads must be a multiple of the KV heads");
    TORCH_CHECK(seq_len >= 1 && seq_len < (1ll << 30), "minfer.blocksparse_attention: empty or oversized sequence");
    const auto dtype = q.scalar_type();
    TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
                "minfer.blocksparse_attention: float16 or bfloat16 only");
    TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && out.scalar_type() == dtype,
                "minfer.blocksparse_attention: q, k, v and out must share one dtype");
    TORCH_CHECK(layout_heads == 1 || layout_heads == q_heads,
                "minfer.blocksparse_attention: layout_heads must be 1 or the number of query heads");
    const int64_t q_tiles = (seq_len + minfer::kBlocksparseTile - 1) / minfer::kBlocksparseTile;
    TORCH_CHECK(tile_ptr.is_cuda() && tile_ptr.is_contiguous() && tile_ptr.scalar_type() == at::kInt &&
                    tile_ptr.numel() == layout_heads * q_tiles + 1,
                "minfer.blocksparse_attention: tile_ptr must be contiguous CUDA int32 of layout_heads * q_tiles + 1");
    TORCH_CHECK(key_tiles.is_cuda() && key_tiles.is_contiguous() && key_tiles.scalar_type() == at::kInt,
                "minfer.blocksparse_attention: key_tiles must be contiguous CUDA int32");
    const auto device = q.device();
    TORCH_CHECK(k.device() == device && v.device() == device && out.device() == device &&
                    tile_ptr.device() == device && key_tiles.device() == device,
                "minfer.blocksparse_attention: tensors on different devices");
    const c10::cuda::CUDAGuard guard(device);
    const char* error = minfer::launch_blocksparse_attention(
        q.data_ptr(), strides_of(q), k.data_ptr(), strides_of(k), v.data_ptr(), strides_of(v), out.data_ptr(),
        strides_of(out), tile_ptr.data_ptr<int>(), key_tiles.data_ptr<int>(), batch, q_heads, kv_heads, layout_heads,
        seq_len, head_dim, (float)scale, dtype == at::kHalf ? minfer::DType::kFloat16 : minfer::DType::kBFloat16,
        kernel, c10::cuda::getCurrentCUDAStream(device.index()).stream());
    TORCH_CHECK(error == nullptr, "minfer.blocksparse_attention: ", error);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void blocksparse_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tile_ptr,
                           const at::Tensor& key_tiles, int64_t layout_heads, double scale, at::Tensor& out) {
    run_blocksparse_attention(q, k, v, tile_ptr, key_tiles, layout_heads, scale, out, minfer::BlocksparseKernel::kAuto);
}

// The same op with the kernel named (benchmarks, tests): "mma", or on sm_90 "wgmma", "ws", "ws-grid", "ws-nopp".
void blocksparse_attention_tuned(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& tile_ptr, const at::Tensor& key_tiles, int64_t layout_heads,
                                 double scale, at::Tensor& out, c10::string_view kernel) {
    minfer::BlocksparseKernel which = minfer::BlocksparseKernel::kMma;
    if (kernel == "wgmma")
        which = minfer::BlocksparseKernel::kWgmma;
    else if (kernel == "ws")
        which = minfer::BlocksparseKernel::kWs;
    else if (kernel == "ws-grid")
        which = minfer::BlocksparseKernel::kWsGrid;
    else if (kernel == "ws-nopp")
        which = minfer::BlocksparseKernel::kWsNoPingPong;
    else
        TORCH_CHECK(kernel == "mma", "minfer.blocksparse_attention_tuned: kernel must be mma, wgmma, ws, ws-grid or "
                                     "ws-nopp");
    if (which != minfer::BlocksparseKernel::kMma) {
        int major = 0;
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.device().index());
        TORCH_CHECK(major == 9, "minfer.blocksparse_attention_tuned: the wgmma kernels need an sm_90 GPU");
    }
    run_blocksparse_attention(q, k, v, tile_ptr, key_tiles, layout_heads, scale, out, which);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minfer, m) {
    m.def("blocksparse_attention(Tensor q, Tensor k, Tensor v, Tensor tile_ptr, Tensor key_tiles, int layout_heads, "
          "float scale, Tensor(a!) out) -> ()");
    m.def("blocksparse_attention_tuned(Tensor q, Tensor k, Tensor v, Tensor tile_ptr, Tensor key_tiles, "
          "int layout_heads, float scale, Tensor(a!) out, str kernel) -> ()");
}

TORCH_LIBRARY_IMPL(minfer, CUDA, m) {
    m.impl("blocksparse_attention", &blocksparse_attention);
    m.impl("blocksparse_attention_tuned", &blocksparse_attention_tuned);
}
