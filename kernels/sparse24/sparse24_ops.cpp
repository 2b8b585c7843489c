// 2:4 sparse matrices (sparse24.h): the decode GEMV and its metadata order, decompression and the sm_90
// prefill GEMM. Each binding checks the tensors and forwards raw pointers to the framework-free launchers.
#include <ATen/ops/empty.h>

#include <array>

#include "common/torch_binding.h"
#include "sparse24/sparse24.h"

namespace {

using namespace minfer::binding;

// values [rows, C32 / 2] fp16/bf16 and meta [rows, C32 / 32] int32 for a matrix of `cols` columns.
void check_sparse24(const at::Tensor& values, const at::Tensor& meta, int64_t cols, const char* op) {
    check_cuda_contiguous(values, "values");
    check_cuda_contiguous(meta, "meta");
    MINFER_CHECK(values.dim() == 2 && meta.dim() == 2 && meta.size(0) == values.size(0), op,
                 ": values [rows, C32 / 2] and meta [rows, C32 / 32] must share their rows");
    MINFER_CHECK(values.scalar_type() == at::kHalf || values.scalar_type() == at::kBFloat16, op,
                 ": values must be float16 or bfloat16, got ", values.scalar_type());
    MINFER_CHECK(meta.scalar_type() == at::kInt, op, ": meta must be int32");
    const int64_t chunks = (cols + minfer::kSparse24ChunkCols - 1) / minfer::kSparse24ChunkCols;
    MINFER_CHECK(cols >= 1 && meta.size(1) == chunks && values.size(1) == chunks * minfer::kSparse24ChunkCols / 2,
                 op, ": a matrix of ", cols, " columns needs meta [rows, ", chunks, "] and values [rows, ",
                 chunks * minfer::kSparse24ChunkCols / 2, "]");
    MINFER_CHECK(values.numel() < INT32_MAX && cols <= INT32_MAX, op, ": the matrix is too large for int32 indices");
    MINFER_CHECK(meta.device() == values.device(), op, ": tensors on different devices");
}

// gemv_meta's shape (sparse24.h) for meta [rows, chunks]: [R8, S, 8, 4].
std::array<int64_t, 4> gemv_meta_shape(int64_t rows, int64_t chunks) {
    return {(rows + minfer::kSparse24GemvRowGroup - 1) / minfer::kSparse24GemvRowGroup,
            (chunks + minfer::kSparse24GemvStepChunks - 1) / minfer::kSparse24GemvStepChunks,
            minfer::kSparse24GemvRowGroup, minfer::kSparse24GemvStepChunks};
}

at::Tensor sparse24_gemv_metadata(const at::Tensor& meta) {
    check_cuda_contiguous(meta, "meta");
    MINFER_CHECK(meta.dim() == 2 && meta.scalar_type() == at::kInt,
                 "minfer.sparse24_gemv_metadata: meta must be int32 [rows, C32 / 32]");
    at::Tensor gemv_meta = at::empty(gemv_meta_shape(meta.size(0), meta.size(1)), meta.options());
    const c10::cuda::CUDAGuard guard(meta.device());
    minfer::launch_sparse24_gemv_metadata(meta.data_ptr<int32_t>(), meta.size(0), meta.size(1),
                                          gemv_meta.data_ptr<int32_t>(), current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return gemv_meta;
}

void sparse24_gemv(const at::Tensor& x, const at::Tensor& values, const at::Tensor& meta,
                   const at::Tensor& gemv_meta, at::Tensor& out, const std::optional<at::Tensor>& norm_weight,
                   double eps, bool accumulate, bool silu_mul) {
    check_cuda_contiguous(x, "x");
    check_cuda_contiguous(out, "out");
    MINFER_CHECK(x.dim() == 2 && out.dim() == 2, "minfer.sparse24_gemv: expects x [T, K] and out [T, N]");
    const int64_t tokens = x.size(0), k = x.size(1), n = values.size(0);
    check_sparse24(values, meta, k, "minfer.sparse24_gemv");
    check_cuda_contiguous(gemv_meta, "gemv_meta");
    const std::array<int64_t, 4> gemv_shape = gemv_meta_shape(n, meta.size(1));
    MINFER_CHECK(gemv_meta.scalar_type() == at::kInt && gemv_meta.sizes().equals(gemv_shape),
                 "minfer.sparse24_gemv: gemv_meta must be int32 ", c10::IntArrayRef(gemv_shape),
                 " (ops.sparse24_gemv_metadata(meta)), got ", gemv_meta.scalar_type(), " ", gemv_meta.sizes());
    MINFER_CHECK(gemv_meta.device() == values.device(), "minfer.sparse24_gemv: gemv_meta on another device");
    MINFER_CHECK(tokens >= 1 && tokens <= minfer::kSparse24MaxTokens, "minfer.sparse24_gemv: takes 1..",
                 minfer::kSparse24MaxTokens, " tokens, got ", tokens);
    MINFER_CHECK(n >= 1, "minfer.sparse24_gemv: the matrix has no rows");
    MINFER_CHECK(!silu_mul || (n % 2 == 0 && !accumulate),
                 "minfer.sparse24_gemv: silu_mul needs [gate; up] with an even N, and no accumulate");
    const int64_t outputs = silu_mul ? n / 2 : n;
    MINFER_CHECK(out.size(0) == tokens && out.size(1) == outputs, "minfer.sparse24_gemv: out must be [", tokens,
                 ", ", outputs, "]");
    MINFER_CHECK(x.scalar_type() == values.scalar_type() && out.scalar_type() == values.scalar_type(),
                 "minfer.sparse24_gemv: x, values and out must share one dtype");
    MINFER_CHECK(x.device() == values.device() && out.device() == values.device(),
                 "minfer.sparse24_gemv: tensors on different devices");
    minfer::ProjectionFusion fusion;
    if (norm_weight.has_value()) {
        check_cuda_contiguous(*norm_weight, "norm_weight");
        MINFER_CHECK(norm_weight->dim() == 1 && norm_weight->size(0) == k,
                     "minfer.sparse24_gemv: norm_weight must be [", k, "]");
        MINFER_CHECK(norm_weight->scalar_type() == x.scalar_type() && norm_weight->device() == x.device(),
                     "minfer.sparse24_gemv: norm_weight must have x's dtype and device");
        MINFER_CHECK(eps >= 0.0, "minfer.sparse24_gemv: eps must be >= 0");
        fusion.norm_weight = norm_weight->data_ptr();
        fusion.eps = (float)eps;
    }
    fusion.accumulate = accumulate;
    fusion.silu_mul = silu_mul;
    MINFER_CHECK(at::get_overlap_status(x, out) == at::MemOverlapStatus::No,
                 "minfer.sparse24_gemv: out must not overlap x (other blocks still read x while one writes out)");
    const c10::cuda::CUDAGuard guard(values.device());
    minfer::launch_sparse24_gemv(values.data_ptr(), meta.data_ptr<int32_t>(), gemv_meta.data_ptr<int32_t>(),
                                 x.data_ptr(), out.data_ptr(), tokens, n, k, dtype_of(values), fusion,
                                 current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void sparse24_decompress(const at::Tensor& values, const at::Tensor& meta, at::Tensor& out) {
    check_cuda_contiguous(out, "out");
    MINFER_CHECK(out.dim() == 2 && out.size(0) == values.size(0),
                 "minfer.sparse24_decompress: out must be [rows, cols] with the values' rows");
    check_sparse24(values, meta, out.size(1), "minfer.sparse24_decompress");
    MINFER_CHECK(out.scalar_type() == values.scalar_type() && out.device() == values.device(),
                 "minfer.sparse24_decompress: out must have the values' dtype and device");
    const c10::cuda::CUDAGuard guard(values.device());
    minfer::launch_sparse24_decompress(values.data_ptr(), meta.data_ptr<int32_t>(), out.data_ptr(), out.size(0),
                                       out.size(1), dtype_of(values), current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

minfer::Sparse24GemmTile gemm_tile(const std::string& name) {
    if (name == "auto") return minfer::Sparse24GemmTile::kAuto;
    if (name == "128x128") return minfer::Sparse24GemmTile::k128x128;
    if (name == "128x256") return minfer::Sparse24GemmTile::k128x256;
    MINFER_CHECK(name == "256x128", "minfer.sparse24_gemm: tile is auto, 128x128, 128x256 or 256x128, got ", name);
    return minfer::Sparse24GemmTile::k256x128;
}

void sparse24_gemm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& gemm_meta, at::Tensor& out,
                   c10::string_view tile) {
    const minfer::Sparse24GemmTile tile_choice = gemm_tile(std::string(tile));
    check_cuda_contiguous(x, "x");
    check_cuda_contiguous(out, "out");
    check_cuda_contiguous(values, "values");
    check_cuda_contiguous(gemm_meta, "gemm_meta");
    MINFER_CHECK(x.dim() == 2 && out.dim() == 2 && values.dim() == 2,
                 "minfer.sparse24_gemm: expects x [M, K], values [N, K / 2] and out [M, N]");
    const int64_t m = x.size(0), k = x.size(1), n = values.size(0);
    MINFER_CHECK(k % minfer::kSparse24GemmKMultiple == 0 && n % 8 == 0 && m >= 1 && n >= 1,
                 "minfer.sparse24_gemm: takes K % ", minfer::kSparse24GemmKMultiple, " == 0 and N % 8 == 0, got K=", k,
                 ", N=", n);
    MINFER_CHECK(values.size(1) * 2 == k, "minfer.sparse24_gemm: values must be [N, K / 2] for K=", k);
    const int64_t row_blocks = (n + minfer::kSparse24GemmRowMultiple - 1) / minfer::kSparse24GemmRowMultiple * 4;
    const int64_t k_atoms = (k + 127) / 128 * 2;
    MINFER_CHECK(gemm_meta.scalar_type() == at::kInt && gemm_meta.dim() == 3 && gemm_meta.size(0) == row_blocks &&
                     gemm_meta.size(1) == k_atoms && gemm_meta.size(2) == minfer::kSparse24GemmAtomWords,
                 "minfer.sparse24_gemm: gemm_meta must be int32 [", row_blocks, ", ", k_atoms, ", ",
                 minfer::kSparse24GemmAtomWords, "]");
    MINFER_CHECK(out.size(0) == m && out.size(1) == n, "minfer.sparse24_gemm: out must be [", m, ", ", n, "]");
    MINFER_CHECK(values.scalar_type() == at::kHalf || values.scalar_type() == at::kBFloat16,
                 "minfer.sparse24_gemm: values must be float16 or bfloat16");
    MINFER_CHECK(x.scalar_type() == values.scalar_type() && out.scalar_type() == values.scalar_type(),
                 "minfer.sparse24_gemm: x, values and out must share one dtype");
    MINFER_CHECK(x.device() == values.device() && out.device() == values.device() &&
                     gemm_meta.device() == values.device(),
                 "minfer.sparse24_gemm: tensors on different devices");
    MINFER_CHECK(m < INT32_MAX && values.numel() < INT32_MAX, "minfer.sparse24_gemm: too large for int32 indices");
    const c10::cuda::CUDAGuard guard(values.device());
    const char* error =
        minfer::launch_sparse24_gemm(values.data_ptr(), gemm_meta.data_ptr<int32_t>(), x.data_ptr(), out.data_ptr(),
                                     m, n, k, dtype_of(values), tile_choice, current_stream());
    MINFER_CHECK(error == nullptr, "minfer.sparse24_gemm: ", error);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minfer, m) {
    m.def("sparse24_gemv_metadata(Tensor meta) -> Tensor");
    m.def("sparse24_gemv(Tensor x, Tensor values, Tensor meta, Tensor gemv_meta, Tensor(a!) out, "
          "Tensor? norm_weight=None, float eps=0.0, bool accumulate=False, bool silu_mul=False) -> ()");
    m.def("sparse24_decompress(Tensor values, Tensor meta, Tensor(a!) out) -> ()");
    m.def("sparse24_gemm(Tensor x, Tensor values, Tensor gemm_meta, Tensor(a!) out, str tile=\"auto\") -> ()");
}

TORCH_LIBRARY_IMPL(minfer, CUDA, m) {
    m.impl("sparse24_gemv_metadata", &sparse24_gemv_metadata);
    m.impl("sparse24_gemv", &sparse24_gemv);
    m.impl("sparse24_decompress", &sparse24_decompress);
    m.impl("sparse24_gemm", &sparse24_gemm);
}
